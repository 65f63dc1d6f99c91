"""`/v1/audio/speech/stream` at the edges of the Talker: `opened` means admitted, text beyond a model's text
positions ends its context in the ingress, slow senders cannot hold HTTP speech off the Talker's rows, and a peer
that never answers pings is closed.

Every wait is for a message, an engine counter or the replica's socket count; GUARD_S only bounds a wait that would
otherwise hang.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.serve.conftest import APP, engine_stats, logged_since, replica_logs, speech, wait_for
from tests.serve.test_websocket import Client

pytestmark = pytest.mark.serve
GUARD_S = 300.0
VD = {"model": "vd", "voice": None, "instructions": "A calm, low voice.", "max_new_tokens": 50}


def _idle(model: str) -> bool:
    s = engine_stats(model)
    return s["running"] == s["parked"] == s["held"] == s["waiting"] == 0


def test_opened_means_admitted_and_a_context_beyond_the_talkers_queue_gets_only_a_final_error(base_url):
    """`vd` takes one call and queues one at its handle. With a context holding the call, of two more contexts one
    waits (nothing is sent for it) and one is refused: a final 429 error, never `opened`. When the first ends, the
    waiting one is admitted and only then `opened`."""
    client = Client(base_url)
    try:
        assert client.open("a", **VD)["type"] == "opened"  # held in the engine (no text), holding vd's one call
        for cid in ("b", "c"):
            client.send(type="open", context_id=cid, response_format="pcm", **VD)
        refused = client.until(lambda m: m.get("context_id") in ("b", "c") and m["type"] == "error")
        waiting = "c" if refused["context_id"] == "b" else "b"
        assert refused["final"] is True and refused["status"] == 429, refused
        assert not client.got.of(refused["context_id"], "opened") and not client.got.of(waiting, "opened")
        client.send(type="cancel", context_id="a")
        assert client.done("a")["finish_reason"] == "cancelled"
        assert client.until(lambda m: m.get("context_id") == waiting)["type"] == "opened"
        client.send(type="cancel", context_id=waiting)
        assert client.done(waiting)["finish_reason"] == "cancelled"
        assert not client.got.of(refused["context_id"], "opened") and not client.got.of(refused["context_id"], "done")
    finally:
        client.close()
    wait_for(lambda: _idle("vd"), GUARD_S, 0.1, "vd's engine to be idle")


def test_an_utterance_over_the_text_positions_ends_in_the_ingress_without_a_traceback(base_url):
    """300 four-byte characters pass `max_input_chars` (300) but are 1,200 text positions for the byte-level test
    tokenizer, more than the Talker's `max_text_rows` (1,024) in one utterance. The ingress ends the context (a
    final 400, `input_too_long`) before the text reaches the Talker, with one INFO line and no traceback."""
    before = {**replica_logs("TTSIngress"), **replica_logs("Talker_cv")}
    client = Client(base_url)
    try:
        assert client.open("long", max_new_tokens=50)["type"] == "opened"
        client.send(type="append", context_id="long", text="\U0001F600" * 150)
        client.send(type="append", context_id="long", text="\U0001F600" * 150)
        error = client.done("long")
        assert error["type"] == "error" and error["final"] is True, error
        assert (error["status"], error["error"]["code"], error["error"]["param"]) == (400, "input_too_long", "input")
        assert client.open("next", max_new_tokens=4)["type"] == "opened"  # the socket goes on
        client.send(type="end", context_id="next", text="Short.")
        assert client.done("next")["type"] == "done"
    finally:
        client.close()
    logs = logged_since(before, "TTSIngress") + logged_since(before, "Talker_cv")
    assert "400 input_too_long" in logs and "Traceback" not in logs, logs[-3000:]


def test_slow_senders_cannot_hold_http_speech_off_the_talker(base_url):
    """`cv` has 20 rows. 20 contexts fed a word now and then (far slower than they are spoken) hold every one,
    parked for text between words, and never hit the idle timeout. A plain HTTP request still gets a row: the
    longest-parked context is ended for it (a final 503 `live_text_evicted`), the request is answered 200."""
    slots = engine_stats("cv")["max_running"]
    clients = [Client(base_url), Client(base_url)]  # at most 16 contexts on one connection
    owner = {f"s{i}": clients[i % 2] for i in range(slots)}
    stop = threading.Event()
    try:
        for cid, client in owner.items():
            assert client.open(cid, max_new_tokens=300, input="Hello there ")["type"] == "opened"
        wait_for(lambda: engine_stats("cv")["parked"] == slots, GUARD_S, 0.1, "every row parked for text")

        def trickle():  # a word per context every half second: each completes the one before
            while not stop.wait(0.5):
                for cid, client in owner.items():  # an ended context answers a final-false error: harmless
                    client.send(type="append", context_id=cid, text="a ")

        threading.Thread(target=trickle, daemon=True).start()
        r = httpx.post(f"{base_url}/v1/audio/speech", json=speech(timeout_s=GUARD_S / 2), timeout=GUARD_S)
        assert r.status_code == 200, r.text[:300]
        evicted = _final_error(clients)
        assert evicted["status"] == 503 and evicted["error"]["code"] == "live_text_evicted", evicted
        assert "other requests needed its slot" in evicted["error"]["message"]
    finally:
        stop.set()
        for c in clients:
            c.close()
    wait_for(lambda: _idle("cv"), GUARD_S, 0.1, "cv's engine to be idle")


def _final_error(clients: list[Client]) -> dict:
    """The first final error any of the connections receives (each is read a little at a time, in turn)."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        for client in clients:
            for message in client.got.messages:
                if message["type"] == "error" and message["final"]:
                    return message
            with contextlib.suppress(TimeoutError):
                raw = client.ws.recv(timeout=0.2)
                if isinstance(raw, str):
                    client.got.messages.append(json.loads(raw))
    raise AssertionError("no context ended")


def _websocket_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("TTSIngress", app_name=APP).websocket_stats.remote().result(timeout_s=30)


def test_a_peer_that_never_answers_pings_is_closed(base_url):
    """Serve's proxy (uvicorn with `websockets`) pings every 20 s and fails a connection whose pong does not come
    within 20 s (close code 1011). A client that completes the handshake, opens a context and then never reads or
    answers: its socket is gone from the ingress (its context cancelled) long before the idle timeouts would end
    it (the context's text at 30 s, then the socket without a context 30 s later, with code 1000)."""
    from websockets.client import ClientProtocol
    from websockets.frames import Opcode
    from websockets.uri import parse_uri

    url = urlsplit(base_url)
    baseline = _websocket_stats()["open_websockets"]
    protocol = ClientProtocol(parse_uri(f"ws://{url.netloc}/v1/audio/speech/stream"))
    sock = socket.create_connection((url.hostname, url.port), timeout=GUARD_S)
    try:
        protocol.send_request(protocol.connect())
        sock.sendall(b"".join(protocol.data_to_send()))
        while not protocol.events_received() and protocol.handshake_exc is None:
            protocol.receive_data(sock.recv(65536))
        assert protocol.handshake_exc is None, protocol.handshake_exc
        protocol.send_text(json.dumps({"type": "open", "context_id": "mute", "model": "cv", "voice": "vivian",
                                       "response_format": "pcm", "max_new_tokens": 8}).encode())
        sock.sendall(b"".join(protocol.data_to_send()))
        wait_for(lambda: _websocket_stats()["open_websockets"] == baseline + 1, GUARD_S, 0.2, "the socket")
        # from here the client neither reads nor answers: its pongs stay in `protocol`, never sent
        wait_for(lambda: _websocket_stats()["open_websockets"] == baseline, GUARD_S, 0.5, "the dead peer's close")
        frames = []
        while data := sock.recv(65536):
            protocol.receive_data(data)
            frames += protocol.events_received()
    finally:
        sock.close()
    assert any(getattr(f, "opcode", None) is Opcode.PING for f in frames)
    assert protocol.close_rcvd is not None and protocol.close_rcvd.code == 1011, protocol.close_rcvd
    assert "keepalive ping timeout" in protocol.close_rcvd.reason
    wait_for(lambda: _idle("cv"), GUARD_S, 0.1, "the context's request to leave the engine")
