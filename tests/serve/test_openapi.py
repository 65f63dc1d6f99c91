"""`/openapi.json` describes what the server answers, and a bounded schemathesis run finds no 5xx
(other than the intended 503/504), no undocumented status and no hang."""

from __future__ import annotations

import pytest

from tests.serve.conftest import speech

pytestmark = pytest.mark.serve


def test_openapi_declares_audio_errors_and_the_upload_body(http):
    doc = http.get("/openapi.json").json()
    speech_op = doc["paths"]["/v1/audio/speech"]["post"]
    ok = speech_op["responses"]["200"]["content"]
    assert {"audio/wav", "audio/pcm", "audio/mpeg", "text/event-stream"} <= set(ok) and "application/json" not in ok
    assert {"400", "404", "408", "413", "429", "503", "504"} <= set(speech_op["responses"])
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert "422" not in op["responses"], (path, method)
    error = speech_op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    assert set(doc["components"]["schemas"][error]["properties"]) == {"error"}
    upload = doc["paths"]["/v1/audio/voices"]["post"]["requestBody"]["content"]
    assert {"audio_sample", "name"} <= set(upload["multipart/form-data"]["schema"]["properties"])
    assert "application/json" in upload


def _fuzz(op, base_url: str, failures: list[str], seen: dict[int, int]):
    """A hypothesis test of one operation: valid and invalid inputs (the invalid ones found issue 13's
    int64 overflow); every answer must be documented, 5xx only the intended 503/504, errors as JSON."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    examples = {"/v1/audio/speech": 100, "/v1/audio/voices": 15}.get(op.path, 10)  # uploads encode audio: few

    @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE)
           | op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def run(case):
        if op.path == "/v1/audio/speech" and isinstance(case.body, dict):
            case.body.setdefault("max_new_tokens", 4)  # short audio: the run is about the API, not speech
            if isinstance(case.body.get("max_new_tokens"), int) and case.body["max_new_tokens"] > 16:
                case.body["max_new_tokens"] = 16
        requests = case.body.get("requests") if isinstance(case.body, dict) else None
        if op.path == "/v1/audio/speech/batches" and isinstance(requests, list):  # the same for each item
            for item in (r for r in requests if isinstance(r, dict)):
                if not isinstance(item.get("max_new_tokens"), int) or item["max_new_tokens"] > 16:
                    item["max_new_tokens"] = 4
        response = case.call(base_url=base_url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        documented = op.definition.raw["responses"]
        if response.status_code >= 500 and response.status_code not in (503, 504):
            failures.append(f"{op.method} {op.path}: {response.status_code} {response.text[:300]}")
        elif str(response.status_code) not in documented:
            failures.append(f"{op.method} {op.path}: undocumented {response.status_code} {response.text[:200]}")
        elif response.status_code >= 400 and "error" not in (response.json() or {}):
            failures.append(f"{op.method} {op.path}: {response.status_code} without an error body")

    return run


def test_a_bounded_schemathesis_run_finds_no_server_errors(base_url, http):
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    failures: list[str] = []
    seen: dict[int, int] = {}
    for operation in schema.get_all_operations():
        op = operation.ok()
        if op.method.upper() == "DELETE":
            continue  # would delete the other tests' voices
        _fuzz(op, base_url, failures, seen)()
    assert not failures, "\n".join(failures[:20])
    assert sum(seen.values()) >= 100 and any(s >= 400 for s in seen) and 200 in seen, seen
    assert http.get("/ready").status_code == 200
    assert http.post("/v1/audio/speech", json=speech()).status_code == 200
