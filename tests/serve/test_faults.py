"""Replica deaths mid-stream, on CPU with real Serve: a killed Code2Wav costs no stream anything (its
decodes are sent again), a killed Talker's clients see a failure (raw: an incomplete response; SSE: an
error event without Ray's internals), and the application is ready again within a minute."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import STALL_SEED, replica_pids, speech, wait_for

pytestmark = pytest.mark.serve

FRAMES = 400  # long enough that every stream is mid-way when its replica is killed


@dataclass
class _Stream:
    sse: bool
    started: threading.Event = field(default_factory=threading.Event)
    received: int = 0  # audio bytes
    events: list = field(default_factory=list)
    error: BaseException | None = None
    status: int | None = None


def _run(base_url: str, stream: _Stream, seed: int) -> None:
    body = speech(response_format="pcm", stream=True, max_new_tokens=FRAMES, seed=seed,
                  **({"stream_format": "sse"} if stream.sse else {}))
    try:
        with httpx.stream("POST", f"{base_url}/v1/audio/speech", json=body, timeout=120) as r:
            stream.status = r.status_code
            if stream.sse:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        stream.events.append(event)
                        if event["type"] == "speech.audio.delta":
                            stream.received += len(event["audio"]) * 3 // 4
                            stream.started.set()
            else:
                for data in r.iter_bytes():
                    stream.received += len(data)
                    stream.started.set()
    except BaseException as e:  # noqa: BLE001 - what the client sees is the test's subject
        stream.error = e
    finally:
        stream.started.set()


def _open_streams(base_url: str, raw: int, sse: int) -> tuple[list[_Stream], list[threading.Thread]]:
    streams = [_Stream(sse=False) for _ in range(raw)] + [_Stream(sse=True) for _ in range(sse)]
    threads = [threading.Thread(target=_run, args=(base_url, s, i), daemon=True) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    for s in streams:  # every stream has audio in hand: the kill lands mid-stream
        assert s.started.wait(60) and s.error is None and s.status == 200, (s.status, s.error)
    return streams, threads


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _kill(deployment: str) -> None:
    (pid,) = replica_pids(deployment)
    os.kill(pid, signal.SIGKILL)


def test_killed_code2wav_replica_streams_complete_through_the_retry(base_url):
    streams, threads = _open_streams(base_url, raw=3, sse=2)
    _kill("Code2Wav")
    for t in threads:
        t.join(150)
    expected = FRAMES * SAMPLES_PER_FRAME * 2
    for s in streams:
        assert s.error is None, repr(s.error)
        assert s.received == expected, (s.received, expected, s.events[-1:] if s.sse else None)
        if s.sse:
            assert s.events[-1]["type"] == "speech.audio.done", s.events[-1]
    wait_for(lambda: _ready(base_url), 60, 0.5, "/ready after the Code2Wav replica was replaced")


def test_killed_talker_replica_streams_fail_visibly_and_ready_recovers(base_url):
    streams, threads = _open_streams(base_url, raw=3, sse=2)
    _kill("Talker:cv")
    killed = time.monotonic()
    for t in threads:
        t.join(60)
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
    wait_for(lambda: _ready(base_url), 60, 0.5, "/ready after the Talker replica was replaced")
    print(f"/ready again {time.monotonic() - killed:.1f} s after the kill")
    ok = httpx.post(f"{base_url}/v1/audio/speech", json=speech(), timeout=60)
    assert ok.status_code == 200, ok.text[:300]


def test_an_engine_that_stops_stepping_fails_health_and_its_replica_is_replaced(base_url):
    """The `fake` model's engine stalls on a request seeded STALL_SEED (a device call that never returns):
    its heartbeat goes stale, check_health raises, and Serve replaces the replica."""
    (old,) = replica_pids("Talker:fake")
    stuck = httpx.post(f"{base_url}/v1/audio/speech", timeout=60,
                       json=speech(model="fake", seed=STALL_SEED, timeout_s=3, response_format="pcm"))
    assert stuck.status_code == 504, stuck.text[:300]
    wait_for(lambda: replica_pids("Talker:fake") not in ([], [old]), 60, 0.5, "a new Talker:fake replica")
    wait_for(lambda: _ready(base_url), 60, 0.5, "/ready with the new replica")
    ok = httpx.post(f"{base_url}/v1/audio/speech", json=speech(model="fake", response_format="pcm"), timeout=60)
    assert ok.status_code == 200 and len(ok.content) == 6 * SAMPLES_PER_FRAME * 2, ok.text[:300]
