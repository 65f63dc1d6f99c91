"""Bad input -> a 4xx with an OpenAI-style error naming the problem; overload -> fast 429 + Retry-After."""

from __future__ import annotations

import asyncio
import base64
import json
import re

import httpx
import openai
import pytest

from tests.serve.conftest import (
    PAUSE_SEED,
    engine_stats,
    logged_since,
    replica_logs,
    speech,
    wait_for,
    wav_bytes,
)

pytestmark = pytest.mark.serve

BAD_AUDIO = base64.b64encode(b"this is not audio at all" * 10).decode()


def _check_error(response: httpx.Response, status: int, param: str | None, fragment: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert fragment.lower() in error["message"].lower(), error["message"]
    return error


@pytest.mark.parametrize("fields, status, param, fragment", [
    ({"model": "gpt-9"}, 404, "model", "not served"),
    ({"voice": "nobody"}, 400, "voice", "unknown voice 'nobody'"),
    ({"language": "Klingon"}, 400, None, "unsupported language"),
    ({"task_type": "Base"}, 400, "task_type", "cannot do task_type Base"),
    ({"task_type": "Singing"}, 400, "task_type", "input should be"),
    ({"input": ""}, 400, "input", "empty"),
    ({"input": "x" * 301}, 400, "input", "limit is 300"),
    ({"response_format": "ogg"}, 400, "response_format", "input should be"),
    ({"speed": 5.0}, 400, "speed", "less than or equal to 4"),
    ({"max_new_tokens": 60000}, 400, "max_new_tokens", "above this model's limit"),
    ({"max_new_tokens": 511}, 400, "max_new_tokens", "exceeds the model's max_seq_len"),  # checked by the ingress
    ({"temperature": -1}, 400, "temperature", "greater than or equal to 0"),
    ({"stream": False, "stream_format": "sse"}, 400, None, "cannot be combined"),
    ({"unknown_field": 1}, 400, "unknown_field", "extra inputs"),
    ({"model": "vd", "voice": None}, 400, "instructions", "needs `instructions`"),
    ({"model": "vd", "voice": None, "instructions": "x" * 4097}, 400, "instructions", "limit is 4096"),
    ({"ref_audio": BAD_AUDIO, "ref_text": "x"}, 400, "ref_audio", "only valid for Base"),
    ({"model": "base", "voice": None}, 400, "voice", "needs a voice"),
    ({"model": "base", "voice": None, "ref_audio": BAD_AUDIO, "ref_text": "x"}, 400, "ref_audio", "could not be decoded"),
    ({"model": "base", "voice": None, "ref_audio": "@@@not base64@@@", "ref_text": "x"}, 400, "ref_audio", "base64"),
    ({"model": "base", "voice": None, "ref_audio": "file:///etc/passwd", "ref_text": "x"}, 400, "ref_audio",
     "local files"),
    ({"model": "base", "voice": None, "ref_audio": "/etc/passwd", "ref_text": "x"}, 400, "ref_audio", "local files"),
    ({"model": "base", "voice": None, "ref_audio": "A" * 500_000, "ref_text": "x"}, 413, "ref_audio",
     "larger than"),
    ({"model": "base", "voice": None, "ref_audio": base64.b64encode(wav_bytes(6.0)).decode(), "ref_text": "x"}, 400,
     "ref_audio", "limit is 5"),
    ({"model": "base", "voice": None, "ref_audio": base64.b64encode(wav_bytes(1.0)).decode()}, 400, "ref_text",
     "needs `ref_text`"),
])
def test_bad_input_is_a_named_4xx(http, fields, status, param, fragment):
    _check_error(http.post("/v1/audio/speech", json=speech(**fields)), status, param, fragment)


def test_urls_must_be_on_the_allowlist(http, file_server):
    body = speech(model="base", voice=None, x_vector_only_mode=True)
    _check_error(http.post("/v1/audio/speech", json={**body, "ref_audio": f"{file_server}/other/clip.wav"}),
                 400, "ref_audio", "allowlist")
    _check_error(http.post("/v1/audio/speech", json={**body, "ref_audio": f"{file_server}/allowed/missing.wav"}),
                 400, "ref_audio", "HTTP 404")


def test_malformed_and_oversized_bodies(http):
    r = http.post("/v1/audio/speech", content=b'{"input": "hi", ', headers={"content-type": "application/json"})
    _check_error(r, 400, None, "not valid JSON")
    r = http.post("/v1/audio/speech", content=json.dumps(speech(input="x" * 1_100_000)),
                  headers={"content-type": "application/json"})
    _check_error(r, 413, None, "larger than")
    _check_error(http.post("/v1/audio/speech", json=["a list"]), 400, None, "")
    _check_error(http.get("/v1/nothing"), 404, None, "not found")


def test_openai_client_raises_typed_errors(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.audio.speech.create(model="cv", voice="nobody", input="hi")
    assert e.value.body["param"] == "voice"
    with pytest.raises(openai.NotFoundError):
        openai_client.audio.speech.create(model="tts-9", voice="vivian", input="hi")


def test_deadline_ends_requests(http):
    """A stream of the fake engine paused after 4 frames: mid-way for sure when its deadline passes."""
    paused = speech(model="fake", seed=PAUSE_SEED, timeout_s=5, response_format="pcm")  # first audio well within it
    _check_error(http.post("/v1/audio/speech", json={**paused, "stream": False}), 504, None, "deadline")
    with http.stream("POST", "/v1/audio/speech", json={**paused, "stream_format": "sse"}) as r:
        assert r.status_code == 200  # the first audio came before the deadline
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "speech.audio.error" and events[-1]["error"]["code"] == "timeout"
    # the Talker was told to stop: the engine drops the request at its next step
    wait_for(lambda: engine_stats("fake")["running"] == 0, 30, 0.02, "the timed-out requests to leave the engine")


def test_full_model_answers_fast_429_with_retry_after(base_url):
    """`fake` holds 2 speech requests open per replica and 1 more waits for a slot at the ingress; paused streams
    hold the 2 until the test closes them.

    The two streams are admitted first, one after the other (each one's first audio has arrived). Of 4 more
    concurrent requests, however the ingress batches them into calls (Serve's call bound is above the replica's,
    so no call waits whole in Serve's queue), the replica refuses each; the first refused waits for a slot, sent
    again until its own deadline (504), and 3 are refused at once. Each refusal is one line in the ingress's log,
    Serve's access line (the ingress adds none at INFO, and Serve's router warning is dropped)."""
    body = speech(model="fake", seed=PAUSE_SEED, timeout_s=5, response_format="pcm")
    # the holders' deadline is far beyond anything a loaded machine takes to admit both and send the burst
    held_body = {**body, "timeout_s": 300, "stream": True, "stream_format": "sse"}
    logs_before = replica_logs("TTSIngress")

    async def hold(client: httpx.AsyncClient, admitted: asyncio.Event) -> None:  # until the test cancels it
        async with client.stream("POST", "/v1/audio/speech", json=held_body) as r:
            assert r.status_code == 200, (r.status_code, (await r.aread())[:300])
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    admitted.set()

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            admitted = [asyncio.Event(), asyncio.Event()]
            holders = []
            for event in admitted:  # one at a time: two at once can race Serve's router into a 429 of its own
                holder = asyncio.create_task(hold(client, event))
                holders.append(holder)
                waiter = asyncio.ensure_future(event.wait())
                await asyncio.wait({waiter, holder}, return_when=asyncio.FIRST_COMPLETED)
                if not event.is_set():
                    waiter.cancel()
                    holder.result()  # its own assertion, if it failed
                    raise AssertionError("a holding stream ended before its first audio")
            burst = await asyncio.gather(*(client.post("/v1/audio/speech", json={**body, "stream": False})
                                           for _ in range(4)))
            holding = [not h.done() for h in holders]
            for h in holders:  # their clients leave: the Talker aborts them
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return burst, holding

    responses, holding = asyncio.run(run())
    assert holding == [True, True]  # both slots were held throughout the burst
    wait_for(lambda: engine_stats("fake")["running"] == 0, 60, 0.05, "the holders aborted")
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [429, 429, 429, 504], statuses
    refused = [r for r in responses if r.status_code == 429]
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
    # refused without waiting for a slot: sooner than the queued request's deadline
    assert max(r.elapsed.total_seconds() for r in refused) < 5
    access = re.compile(r"POST /v1/audio/speech 429 ")
    logs = wait_for(lambda: len(access.findall(text := logged_since(logs_before, "TTSIngress"))) >= 3 and text,
                    60, 0.2, "Serve's access lines of the 429s")
    assert len(access.findall(logs)) == 3, logs[-3000:]
    assert "429 overloaded" not in logs and "Request dropped due to backpressure" not in logs, logs[-3000:]


def test_voice_upload_errors(http):
    clip = wav_bytes(1.0)
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", clip, "audio/wav")}, data={"name": "bad name"})
    _check_error(r, 400, "name", "must match")
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", clip, "audio/wav")}, data={"name": "vivian"})
    _check_error(r, 400, "name", "taken by a preset")
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", b"junk" * 100, "audio/wav")},
                  data={"name": "junk"})
    _check_error(r, 400, "audio_sample", "could not be decoded")
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", b"0" * 300_001, "audio/wav")},
                  data={"name": "big"})
    _check_error(r, 413, "audio_sample", "larger than")
    r = http.post("/v1/audio/voices", json={"name": "x"})
    _check_error(r, 400, None, "multipart/form-data or JSON")
    _check_error(http.delete("/v1/audio/voices/nobody"), 404, "name", "no uploaded voice")


def test_an_upload_never_silently_replaces_a_voice(http):
    """Without keys anyone who reaches the port may upload: a second upload of a name (any case) is a 409 unless
    it asks to replace, so an owner's requests never start speaking someone else's clip unasked."""
    files = {"audio_sample": ("a.wav", wav_bytes(1.0, seed=1), "audio/wav")}
    first = http.post("/v1/audio/voices", files=files, data={"name": "keepme", "x_vector_only_mode": "true"})
    assert first.status_code == 200, first.text
    try:
        other = {"audio_sample": ("b.wav", wav_bytes(1.0, seed=2), "audio/wav")}
        _check_error(http.post("/v1/audio/voices", files=other, data={"name": "KeepMe", "x_vector_only_mode": "true"}),
                     409, "name", "exists")
        names = [v["name"].lower() for v in http.get("/v1/audio/voices").json()["uploaded_voices"]]
        assert names.count("keepme") == 1
        again = http.post("/v1/audio/voices", files=other,
                          data={"name": "KeepMe", "x_vector_only_mode": "true", "replace": "true"})
        assert again.status_code == 200 and again.json()["voice"]["name"] == "KeepMe", again.text
        names = [v["name"] for v in http.get("/v1/audio/voices").json()["uploaded_voices"]]
        assert [n for n in names if n.lower() == "keepme"] == ["KeepMe"]  # replaced, not added
    finally:
        http.delete("/v1/audio/voices/KeepMe")


def test_health_answers_head_and_responses_carry_one_request_id(http):
    assert http.head("/health").status_code == 200
    r = http.post("/v1/audio/speech", json=speech(response_format="pcm"))
    assert r.status_code == 200 and len(r.headers.get_list("x-request-id")) == 1, r.headers
    bad = http.post("/v1/audio/speech", json=speech(voice="nobody"))
    assert bad.status_code == 400 and len(bad.headers.get_list("x-request-id")) == 1


def test_absurd_reference_clips_are_refused(http):
    import io

    import numpy as np
    import soundfile as sf

    def clip(seconds: float, rate: int) -> str:
        buf = io.BytesIO()
        sf.write(buf, np.zeros(max(1, int(seconds * rate)), np.float32), rate, format="WAV", subtype="PCM_16")
        return base64.b64encode(buf.getvalue()).decode()

    body = speech(model="base", voice=None, x_vector_only_mode=True)
    _check_error(http.post("/v1/audio/speech", json={**body, "ref_audio": clip(0.2, 24000)}), 400, "ref_audio",
                 "at least 0.5 s")
    _check_error(http.post("/v1/audio/speech", json={**body, "ref_audio": clip(3.0, 1)}), 400, "ref_audio",
                 "sample rate of 1 Hz")
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", base64.b64decode(clip(2.0, 4000)), "audio/wav")},
                  data={"name": "lowrate"})
    _check_error(r, 400, "audio_sample", "at least 8000 Hz")


def test_voice_names_are_case_insensitive_for_delete_too(http):
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", wav_bytes(1.0), "audio/wav")},
                  data={"name": "CaseVoice"})
    assert r.status_code == 200, r.text
    assert http.delete("/v1/audio/voices/casevoice").json() == {"success": True, "name": "CaseVoice"}
    _check_error(http.delete("/v1/audio/voices/CaseVoice"), 404, "name", "no uploaded voice")


def test_malformed_multipart_upload_is_400(http):
    r = http.post("/v1/audio/voices", content=b"--x\r\nnot a part", headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_multipart", r.text
