"""What an operator and a proxy see of a request: its JSON log line in the ingress log, the streaming headers."""

from __future__ import annotations

import hashlib
import json
import uuid

import pytest

from tests.serve.conftest import speech, wait_for

pytestmark = pytest.mark.serve


def _request_lines() -> list[dict]:
    from pathlib import Path

    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"  # no public accessor
    lines = []
    for path in logs.glob("replica_tts_TTSIngress*.log"):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find('{"event":"tts.request"')
            if start >= 0:
                lines.append(json.loads(line[start:]))
    return lines


def _line(request_id: str) -> dict:
    found = wait_for(lambda: [x for x in _request_lines() if x["request_id"] == request_id], 30, 0.2,
                     f"the log line of {request_id}")
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("fields", [{"response_format": "pcm"}, {"response_format": "mp3"},
                                    {"response_format": "pcm", "stream_format": "sse"}])
def test_streams_tell_caches_and_proxies_not_to_hold_them(http, fields):
    with http.stream("POST", "/v1/audio/speech", json=speech(stream=True, **fields)) as r:
        assert r.status_code == 200
        assert r.headers["cache-control"] == "no-cache" and r.headers["x-accel-buffering"] == "no"
        r.read()


def test_a_streamed_request_ends_in_one_log_line_naming_its_key_by_hash(http):
    rid = f"op-{uuid.uuid4().hex}"
    with http.stream("POST", "/v1/audio/speech", json=speech(stream=True, response_format="pcm", voice="ryan"),
                     headers={"Authorization": "Bearer sk-test-key", "X-Request-Id": rid}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        audio = r.read()
    line = _line(rid)
    assert (line["model"], line["voice"], line["stream"], line["outcome"], line["status"]) == ("cv", "ryan", True,
                                                                                            "ok", 200)
    assert line["key_hash"] == hashlib.sha256(b"sk-test-key").hexdigest()[:8] and "sk-test-key" not in str(line)
    assert line["input_chars"] == len(speech()["input"]) and line["audio_s"] == pytest.approx(len(audio) / 2 / 24000)
    assert line["first_audio_ms"] > 0 and line["rtf"] > 0 and line["engine_request_id"].startswith("speech-")


def test_a_refused_request_logs_its_outcome_and_status(http):
    rid = f"op-{uuid.uuid4().hex}"
    r = http.post("/v1/audio/speech", json=speech(voice="nobody"), headers={"X-Request-Id": rid})
    assert r.status_code == 400
    line = _line(rid)
    assert (line["outcome"], line["status"], line["key_hash"], line["audio_s"], line["rtf"]) == (
        "bad_request", 400, None, 0, None)
