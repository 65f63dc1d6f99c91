"""Replica deaths mid-stream, on CPU with real Serve: a killed Code2Wav costs no stream anything (its
decodes are sent again), a killed Talker's clients see a failure (raw: an incomplete response; SSE: an
error event without Ray's internals), and the application is ready again.

Every wait is for an event (a stream's end, /ready answering 200, a new replica's process); GUARD_S only bounds a
wait that would otherwise hang, and is far beyond what a loaded 2-core machine needs (a replica's restart there
loads torch and the model and warms up: tens of seconds)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import STALL_SEED, ClientStream, open_streams, replica_pids, speech, wait_for

pytestmark = pytest.mark.serve

FRAMES = 400  # long enough that every stream is mid-way when its replica is killed
GUARD_S = 600.0


def _open_streams(base_url: str, raw: int, sse: int) -> list[ClientStream]:
    """Raw then SSE streams, each with audio in hand: the kill lands mid-stream."""
    return open_streams(base_url, [
        speech(response_format="pcm", stream=True, max_new_tokens=FRAMES, seed=i,
               **({"stream_format": "sse"} if i >= raw else {}))
        for i in range(raw + sse)], timeout=GUARD_S)


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _kill(deployment: str) -> None:
    (pid,) = replica_pids(deployment)
    os.kill(pid, signal.SIGKILL)


def test_killed_code2wav_replica_streams_complete_through_the_retry(base_url):
    streams = _open_streams(base_url, raw=3, sse=2)
    _kill("Code2Wav")
    for s in streams:
        assert s.done.wait(GUARD_S), "a stream did not end"
    expected = FRAMES * SAMPLES_PER_FRAME * 2
    for s in streams:
        assert s.error is None, repr(s.error)
        assert s.received == expected, (s.received, expected, s.events[-1:] if s.sse else None)
        if s.sse:
            assert s.events[-1]["type"] == "speech.audio.done", s.events[-1]
    wait_for(lambda: _ready(base_url), GUARD_S, 0.5, "/ready after the Code2Wav replica was replaced")


def test_killed_talker_replica_streams_fail_visibly_and_ready_recovers(base_url):
    streams = _open_streams(base_url, raw=3, sse=2)
    _kill("Talker:cv")
    killed = time.monotonic()
    for s in streams:
        assert s.done.wait(GUARD_S), "a stream did not end"
    for s in streams:
        assert s.received < FRAMES * SAMPLES_PER_FRAME * 2, "a stream completed although its Talker died"
        if s.sse:
            assert s.error is None, repr(s.error)
            last = s.events[-1]
            assert last["type"] == "speech.audio.error", last
            text = json.dumps(last)
            assert "ActorDiedError" not in text and "Traceback" not in text and "0x" not in text, text
            assert last["error"]["code"] == "replica_failed"
        else:  # no terminating chunk: the client knows the audio is incomplete
            assert isinstance(s.error, httpx.RemoteProtocolError), repr(s.error)
    wait_for(lambda: _ready(base_url), GUARD_S, 0.5, "/ready after the Talker replica was replaced")
    print(f"/ready again {time.monotonic() - killed:.1f} s after the kill")
    ok = httpx.post(f"{base_url}/v1/audio/speech", json=speech(), timeout=GUARD_S)
    assert ok.status_code == 200, ok.text[:300]


def test_an_engine_that_stops_stepping_fails_health_and_its_replica_is_replaced(base_url):
    """The `fake` model's engine stalls on a request seeded STALL_SEED (a device call that never returns):
    its heartbeat goes stale, check_health raises and ends the replica's streams (503), and Serve replaces the
    replica without waiting out its graceful stop for the stuck request. The client's deadline (504) is the
    fallback, should a loaded machine make it come first (a deadline short enough to pass before the stall could
    end the request before the engine ever took it)."""
    (old,) = replica_pids("Talker:fake")
    answers: list[httpx.Response] = []
    body = speech(model="fake", seed=STALL_SEED, timeout_s=GUARD_S / 4, response_format="pcm")
    client = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{base_url}/v1/audio/speech", timeout=GUARD_S, json=body)), daemon=True)
    client.start()
    wait_for(lambda: replica_pids("Talker:fake") not in ([], [old]), GUARD_S, 0.5, "a new Talker:fake replica")
    client.join(GUARD_S)
    assert answers and answers[0].status_code in (503, 504), answers[0].text[:300] if answers else "no answer"
    wait_for(lambda: _ready(base_url), GUARD_S, 0.5, "/ready with the new replica")
    ok = httpx.post(f"{base_url}/v1/audio/speech", json=speech(model="fake", response_format="pcm"),
                    timeout=GUARD_S)
    assert ok.status_code == 200 and len(ok.content) == 6 * SAMPLES_PER_FRAME * 2, ok.text[:300]
