"""`/v1/audio/speech/stream` under abuse: sockets without a context are closed after the idle timeout, and the
sockets of an ingress replica (in all, and per client address) are capped while /health keeps answering.

Each class deploys a small app (the tiny CustomVoice checkpoint, the tiny codec) with the limits it tests set small;
classes with the same limits share it, and the classes that test no limit (each holds one socket at a time) take the
socket caps' (a deployment fewer). Every wait is for a message or a close frame, with a generous timeout.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.serve.conftest import ZERO_CPU, wait_for

RECV_TIMEOUT_S = 120.0
APP_NAME = "ws-abuse"


def _deploy(base_url: str, tiny_custom_voice, tmp_path_factory, **ingress) -> None:
    from ray import serve

    from deployments.builder import build_app

    args = {
        "models": [{"name": "cv", "model": str(tiny_custom_voice), "device": "cpu", "cpu_threads": 1,
                    "engine_kwargs": {"max_num_seqs": 2, "max_seq_len": 512}, "deployment_config": ZERO_CPU}],
        "code2wav": {"device": "cpu", "cpu_threads": 1, "max_batch_size": 4, "deployment_config": ZERO_CPU},
        "ingress": {"voices_dir": str(tmp_path_factory.mktemp("voices")), "allow_suppress_eos": True,
                    "deployment_config": {**ZERO_CPU, "num_replicas": 1}, **ingress},
    }
    serve.run(build_app(args), name=APP_NAME, route_prefix=f"/{APP_NAME}")  # beside the session's app at /
    wait_for(lambda: httpx.get(f"{base_url}/ready", timeout=10).status_code == 200, 120, 0.5, "/ready")


@pytest.fixture(scope="module")
def deployed(ray_cluster):
    """The ingress settings of the app deployed now (None: none), so classes asking for the same keep it."""
    from ray import serve

    current: dict = {"ingress": None}
    yield current
    if current["ingress"] is not None:
        serve.delete(APP_NAME, _blocking=False)  # no later test deploys this name: its replicas stop meanwhile


@pytest.fixture(scope="class")
def app(request, ray_cluster, deployed, tiny_custom_voice, tmp_path_factory):
    from ray import serve

    base_url = f"{ray_cluster}/{APP_NAME}"
    if deployed["ingress"] != request.cls.INGRESS:  # classes with the same limits share one deployment
        if deployed["ingress"] is not None:
            serve.delete(APP_NAME)
            deployed["ingress"] = None
        _deploy(base_url, tiny_custom_voice, tmp_path_factory, **request.cls.INGRESS)
        deployed["ingress"] = request.cls.INGRESS
    yield base_url


def _connect(base_url: str, source: str = "127.0.0.1"):
    """A WebSocket to the app from the loopback address `source` (each its own client address)."""
    from websockets.sync.client import connect

    url = urlsplit(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=RECV_TIMEOUT_S, source_address=(source, 0))
    return connect(f"ws://{url.netloc}{url.path}/v1/audio/speech/stream", sock=sock, max_size=None).__enter__()


def _until_closed(ws) -> list:
    """Every message received until the server's close frame (raises if none comes in time)."""
    from websockets.exceptions import ConnectionClosed

    got = []
    try:
        while True:
            got.append(ws.recv(timeout=RECV_TIMEOUT_S))
    except ConnectionClosed:
        return got


def _stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("TTSIngress", app_name=APP_NAME).websocket_stats.remote().result(timeout_s=30)


class TestIdleSockets:
    INGRESS = {"websocket_idle_timeout_s": 1.0}

    def test_a_socket_without_a_context_is_closed_after_the_idle_timeout(self, app):
        started = time.monotonic()  # before the connect: the server's clock starts at its accept, after this
        ws = _connect(app)
        assert _until_closed(ws) == []
        assert ws.close_code in (1000, 1001) and "no open context" in ws.close_reason, (ws.close_code, ws.close_reason)
        assert time.monotonic() - started > 0.9  # not at once: after the 1 s idle timeout
        wait_for(lambda: _stats()["open_websockets"] == 0, 60, message="the closed socket uncounted")

    def test_an_open_context_keeps_the_socket_and_the_idle_time_starts_at_its_end(self, app):
        ws = _connect(app)
        ws.send(json.dumps({"type": "open", "context_id": "a", "model": "cv", "voice": "vivian",
                            "response_format": "pcm", "suppress_eos": True, "max_new_tokens": 40,
                            "input": "Some words and"}))  # it speaks its text, then waits for more
        assert json.loads(ws.recv(timeout=RECV_TIMEOUT_S))["type"] == "opened"
        time.sleep(3)  # three idle timeouts with a context open (waiting for text): the socket stays
        ws.send(json.dumps({"type": "end", "context_id": "a", "text": " more."}))
        got = [json.loads(m) for m in _until_closed(ws) if isinstance(m, str)]
        assert [m["type"] for m in got] == ["done"], got  # the context ran to its end, then the socket closed
        assert got[0]["usage"]["output_tokens"] == 40, got
        assert ws.close_code == 1000, ws.close_code


class TestSocketCaps:
    INGRESS = {"max_websockets_per_replica": 4, "max_websockets_per_client": 3, "websocket_idle_timeout_s": 600}

    @staticmethod
    def _refused(ws) -> None:
        got = _until_closed(ws)
        assert ws.close_code == 1013, (ws.close_code, ws.close_reason)
        error = json.loads(got[0])
        assert error["type"] == "error" and error["final"] is True, error
        assert error["status"] == 503 and error["error"]["code"] == "too_many_connections", error

    def test_sockets_are_capped_per_client_and_per_replica_and_health_answers(self, app):
        held = [_connect(app) for _ in range(3)]
        wait_for(lambda: _stats()["open_websockets"] == 3, 60, message="3 sockets counted")
        self._refused(_connect(app))  # a 4th from the same address
        held.append(_connect(app, "127.0.0.2"))  # another address: the replica's 4th
        wait_for(lambda: _stats()["open_websockets"] == 4, 60, message="4 sockets counted")
        self._refused(_connect(app, "127.0.0.3"))  # the replica is full
        assert httpx.get(f"{app}/health", timeout=30).status_code == 200
        held[0].send(json.dumps({"type": "cancel", "context_id": "x"}))  # the held sockets still work
        assert json.loads(held[0].recv(timeout=RECV_TIMEOUT_S))["error"]["code"] == "context_not_found"
        for ws in held:
            ws.close()
        wait_for(lambda: _stats() == {"open_websockets": 0, "client_addresses": 0}, 60, message="sockets uncounted")
        ws = _connect(app, "127.0.0.3")  # room again
        ws.send(json.dumps({"type": "cancel", "context_id": "x"}))
        assert json.loads(ws.recv(timeout=RECV_TIMEOUT_S))["error"]["code"] == "context_not_found"
        ws.close()


class TestSlowSender:
    """Contexts fed a character now and then hold every Talker slot (2 here) while they wait for text: an HTTP
    request that needs a slot takes the one parked longest (after `live_evict_parked_s`, 1 s), and that context
    ends with a final `text_evicted` error instead of the HTTP request timing out."""

    INGRESS = TestSocketCaps.INGRESS  # no limit of these binds one socket

    def test_http_speech_gets_a_slot_held_by_trickling_live_contexts(self, app):
        import threading

        from tests.serve.conftest import speech

        ws = _connect(app)
        try:
            for cid in ("a", "b"):
                ws.send(json.dumps({"type": "open", "context_id": cid, "model": "cv", "voice": "vivian",
                                    "input": "Hello there, my", "max_new_tokens": 300, "response_format": "pcm"}))
            with_audio: set[str] = set()
            while with_audio != {"a", "b"}:  # both run (and park once their first words are spoken)
                msg = ws.recv(timeout=RECV_TIMEOUT_S)
                if isinstance(msg, bytes):
                    with_audio.add(msg[1:1 + msg[0]].decode())
                else:
                    assert not json.loads(msg).get("final"), msg
            stop, sent_all = threading.Event(), threading.Event()

            def trickle():  # one character per context every 0.2 s: each resets the idle timeout, none ends a word
                while not stop.wait(0.2):
                    for cid in ("a", "b"):
                        ws.send(json.dumps({"type": "append", "context_id": cid, "text": "y"}))
                sent_all.set()

            threading.Thread(target=trickle, daemon=True).start()
            r = httpx.post(f"{app}/v1/audio/speech", json=speech(), timeout=RECV_TIMEOUT_S)
            assert r.status_code == 200, r.text[:300]
            finals = []
            while not finals:
                msg = ws.recv(timeout=RECV_TIMEOUT_S)
                if isinstance(msg, str):
                    event = json.loads(msg)
                    if event.get("final") or event.get("type") == "done":
                        finals.append(event)
            stop.set()
            sent_all.wait(RECV_TIMEOUT_S)
        finally:
            ws.close()
        assert finals[0]["type"] == "error" and finals[0]["error"]["code"] == "text_evicted", finals[0]
        assert finals[0]["status"] == 408


def _raw_websocket(base_url: str) -> socket.socket:
    """A WebSocket handshake by hand on a plain socket: a peer that will never read again (so never answers a
    ping) once the handshake's answer is in."""
    import base64
    import os

    url = urlsplit(base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=RECV_TIMEOUT_S)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET {url.path}/v1/audio/speech/stream HTTP/1.1\r\nHost: {url.netloc}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(1)  # byte by byte: nothing past the handshake is read
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return sock


def _masked_text_frame(text: str) -> bytes:
    """One client text frame (RFC 6455: FIN, opcode 1, masked)."""
    import os
    import struct

    data, mask = text.encode(), os.urandom(4)
    n = len(data)
    header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n))
    return header + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data))


class TestDeadPeers:
    INGRESS = TestSocketCaps.INGRESS  # no limit of these binds one socket (the context's own idle timeout is 600 s)

    def test_a_peer_that_never_answers_pings_is_closed_and_its_context_ended(self, app):
        """A context open and waiting for text (its own idle timeout 10 minutes), the socket's peer gone silent: the
        proxy's keepalive (a ping every 20 s, 20 s for the pong) closes it, and the session ends the context."""
        # a class before may share this deployment: its sockets gone first, so the counts below are this one's
        wait_for(lambda: _stats()["open_websockets"] == 0, 120, 0.5, "the earlier sockets closed")
        sock = _raw_websocket(app)
        sock.sendall(_masked_text_frame(json.dumps({
            "type": "open", "context_id": "d", "model": "cv", "voice": "vivian", "response_format": "pcm",
            "suppress_eos": True, "max_new_tokens": 40, "idle_timeout_s": 600, "input": "Some words and"})))
        wait_for(lambda: _stats()["open_websockets"] == 1, 60, message="the socket opened")
        wait_for(lambda: _stats()["open_websockets"] == 0, 150, 1.0, "the dead peer's socket closed by keepalive")
        sock.close()


class TestWithoutAligner:
    """An app without an `aligner` block: timestamps are refused with a 400 naming the field, over HTTP and on the
    WebSocket (a final error for that context only)."""

    INGRESS = TestSocketCaps.INGRESS  # no limit of these binds one socket

    def test_timestamps_without_an_aligner_are_a_400_naming_the_field(self, app):
        body = {"model": "cv", "voice": "vivian", "input": "Hello.", "max_new_tokens": 4, "suppress_eos": True,
                "timestamps": "word"}
        r = httpx.post(f"{app}/v1/audio/speech", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "timestamps"
        assert r.json()["error"]["code"] == "timestamps_unavailable"
        ws = _connect(app)
        try:
            ws.send(json.dumps({"type": "open", "context_id": "t", "model": "cv", "voice": "vivian",
                                "timestamps": "word"}))
            error = json.loads(ws.recv(timeout=RECV_TIMEOUT_S))
            assert error["type"] == "error" and error["final"] and error["status"] == 400
            assert error["error"]["param"] == "timestamps"
            ws.send(json.dumps({"type": "open", "context_id": "u", "model": "cv", "voice": "vivian"}))
            assert json.loads(ws.recv(timeout=RECV_TIMEOUT_S))["type"] == "opened"  # the socket goes on
        finally:
            ws.close()
