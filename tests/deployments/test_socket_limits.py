"""The ingress's WebSocket bounds without a cluster: the socket counts, the settings, the context-id parse."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from deployments.config import IngressConfig
from deployments.ingress.schemas import context_id_of
from deployments.ingress.socket_limits import SocketLimits


def test_sockets_are_counted_per_replica_and_per_client_and_forgotten_after_release():
    limits = SocketLimits(per_replica=3, per_client=2)
    assert limits.admit("a") is None and limits.admit("a") is None
    assert "client address" in limits.admit("a")
    assert limits.admit("b") is None
    assert "replica" in limits.admit("c")
    assert limits.stats() == {"open_websockets": 3, "client_addresses": 2}
    for client in ("a", "a", "b"):
        limits.release(client)
    assert limits.stats() == {"open_websockets": 0, "client_addresses": 0}  # no entry per address stays
    assert limits.admit("c") is None


def test_the_settings_have_defaults_below_an_outage_and_environment_overrides():
    config = IngressConfig()
    assert config.websocket_idle_timeout_s == 30.0
    assert config.max_websockets_per_replica == 1024 and config.max_websockets_per_client == 64
    env = {**os.environ, "QWEN3_TTS_WEBSOCKET_IDLE_TIMEOUT_S": "5", "QWEN3_TTS_MAX_WEBSOCKETS_PER_REPLICA": "10",
           "QWEN3_TTS_MAX_WEBSOCKETS_PER_CLIENT": "2"}
    code = ("from deployments.config import IngressConfig as C; c = C(); "
            "print(c.websocket_idle_timeout_s, c.max_websockets_per_replica, c.max_websockets_per_client)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["5.0", "10", "2"]


def test_the_context_id_of_a_bad_message_never_raises():
    assert context_id_of(json.dumps({"context_id": "c1", "type": "nope"})) == "c1"
    assert context_id_of("[" * 5_000 + "]" * 5_000) is None  # too deep for json.loads: RecursionError
    assert context_id_of('{"context_id": "c1", "x": ' + "[" * 5_000 + "]" * 5_000 + "}") is None
    assert context_id_of(json.dumps({"context_id": "c1", "text": "x" * 100_000})) is None  # not parsed again
    assert context_id_of("not json") is None
