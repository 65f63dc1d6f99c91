"""Hostile requests: each is a clean 4xx (or a 504 for its own deadline), and the service keeps serving.

An integer above int64 in a sampling field used to raise on the Talker's engine thread and take the
replica down (issue 13); a lone surrogate crashed the tokenizer with a 500.
"""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest

from tests.serve.conftest import engine_stats, replica_logs, speech

pytestmark = pytest.mark.serve

INT_FIELDS = ("max_new_tokens", "seed", "initial_codec_chunk_frames", "top_k", "subtalker_top_k", "min_frames")
HUGE = (2**63, 2**64 + 1, -(2**63) - 1, 10**40)


def _post_raw(http: httpx.Client, text: str) -> httpx.Response:
    """A body as exact JSON text (json.dumps would escape or refuse what the test needs to send)."""
    return http.post("/v1/audio/speech", content=text.encode(), headers={"content-type": "application/json"})


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def _still_serves(http: httpx.Client) -> None:
    ok = http.post("/v1/audio/speech", json=speech(response_format="pcm"))
    assert ok.status_code == 200 and len(ok.content) > 0, ok.text[:500]


@pytest.mark.parametrize("field", INT_FIELDS)
def test_integers_out_of_range_are_400_and_the_engine_survives(http, field):
    steps_before = engine_stats("cv")["steps"]
    for value in HUGE:
        error = _error(_post_raw(http, json.dumps(speech(**{field: value}))), 400)
        assert error["param"] == field and str(value) not in error["message"]
    _still_serves(http)
    assert engine_stats("cv")["steps"] > steps_before  # the same engine stepped on: nothing died


@pytest.mark.parametrize("text", ['NaN', 'Infinity', '-Infinity', '1e999'])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "timeout_s", "speed"])
def test_non_finite_floats_are_400(http, field, text):
    body = json.dumps(speech())[:-1] + f', "{field}": {text}}}'
    assert _error(_post_raw(http, body), 400)["param"] == field


@pytest.mark.parametrize("field", ["input", "voice", "model", "language", "instructions", "ref_text"])
def test_lone_surrogates_are_400_not_500(http, field):
    body = json.dumps(speech(**{field: "PLACEHOLDER"})).replace("PLACEHOLDER", "a\\ud800b")
    error = _error(_post_raw(http, body), 400)
    assert error["param"] == field


def test_any_valid_unicode_is_accepted(http):
    r = http.post("/v1/audio/speech", json=speech(input="Grüße, 你好, مرحبا, 🎉 \U0010fffd."))
    assert r.status_code == 200, r.text


def test_validation_comes_before_the_deadline(http):
    assert _error(http.post("/v1/audio/speech", json=speech(input="", timeout_s=5e-324)), 400)["param"] == "input"
    assert _error(http.post("/v1/audio/speech", json=speech(max_new_tokens=511, timeout_s=5e-324)), 400)["param"] \
        == "max_new_tokens"
    assert _error(http.post("/v1/audio/speech", json=speech(top_k=2**63, timeout_s=5e-324)), 400)["param"] == "top_k"
    # a valid request with that deadline times out
    assert _error(http.post("/v1/audio/speech", json=speech(timeout_s=5e-324)), 504)["code"] == "timeout"


@pytest.mark.parametrize("fields", [
    {"voice": "v" * 900_000},
    {"model": "m" * 900_000},
    {"language": "l" * 900_000},
    {"response_format": "f" * 900_000},
    {"x" * 900_000: 1},
])
def test_error_bodies_do_not_echo_huge_values(http, fields):
    r = http.post("/v1/audio/speech", json=speech(**fields))
    assert r.status_code == 400, r.text[:300]
    assert len(r.content) < 2000, len(r.content)


def test_undecodable_audio_message_has_no_library_internals(http):
    import base64

    body = speech(model="base", voice=None, ref_text="x", ref_audio=base64.b64encode(b"RIFF" + b"\0" * 400).decode())
    error = _error(http.post("/v1/audio/speech", json=body), 400)
    assert error["param"] == "ref_audio" and "0x" not in error["message"] and "<" not in error["message"]


def _records_of(logs: str, ours: set[str]) -> list[str]:
    """The log records (a header line and what follows it) of these request ids, and those of no request: a record
    of another request (a late one of an earlier test, e.g. a killed replica's stream) is not this test's."""
    records = re.split(r"\n(?=(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-\d\d-\d\d )", logs)
    kept = []
    for record in records:
        head = record.split(" -- ", 1)[0].split()  # level, date, time, deployment, replica[, request id]
        if len(head) < 6 or head[5] in ours:
            kept.append(record)
    return kept


def test_client_errors_leave_no_traceback_in_the_server_logs(http):
    before = {**replica_logs("TTSIngress"), **replica_logs("Talker_cv_")}  # earlier tests' lines are not ours
    bodies = [speech(top_k=2**63), speech(max_new_tokens=511), speech(input="a\ud800b"), speech(voice="nobody"),
              speech(model="nothing"), speech(input="")]
    ours = {f"hostile-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(bodies))}
    for body, request_id in zip(bodies, sorted(ours), strict=True):
        r = http.post("/v1/audio/speech", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json", "x-request-id": request_id})
        assert 400 <= r.status_code < 500, r.text[:300]
    after = {**replica_logs("TTSIngress"), **replica_logs("Talker_cv_")}
    logs = "".join(text[len(before.get(path, "")):] for path, text in after.items())
    assert "400 voice_not_found: unknown voice" in logs  # each client error is one line in the ingress's log
    assert any(request_id in logs for request_id in ours)  # the records carry the ids the requests were sent with
    mine = "".join(_records_of(logs, ours))
    assert "Traceback" not in mine, mine[mine.index("Traceback") - 2000:][:4000]
