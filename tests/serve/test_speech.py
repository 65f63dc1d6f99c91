"""/v1/audio/speech through a real Serve cluster: formats, streaming (raw, SSE), the openai client, routing."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
import soundfile as sf

from deployments.first_audio_timing import parse_server_timing
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.serve.conftest import APP, code2wav_stats, engine_stats, pcm_of, speech, wait_for

pytestmark = pytest.mark.serve


def test_health_ready_and_models(http):
    assert http.get("/health").json() == {"status": "ok"}
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert set(ready.json()["deployments"]) == {"cv", "base", "vd", "cv-scale", "fake", "Code2Wav", "Aligner"}
    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert set(models) == {"cv", "base", "vd", "cv-scale", "fake"}
    assert models["cv"]["task_type"] == "CustomVoice" and models["cv"]["aliases"] == ["tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    assert "vivian" in models["cv"]["speakers"] and models["base"]["task_type"] == "Base"


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus"])
def test_every_format_decodes_to_the_right_rate_and_length(openai_client, fmt):
    response = openai_client.audio.speech.create(
        model="cv", voice="vivian", input="Every format.", response_format=fmt,
        extra_body={"max_new_tokens": 6, "suppress_eos": True, "seed": 7, "stream": False},  # one whole body
    )
    data = response.content
    if fmt == "pcm":
        audio, sr = pcm_of(data), SAMPLE_RATE
    else:
        audio, sr = sf.read(io.BytesIO(data), dtype="int16")
    assert sr == SAMPLE_RATE
    assert audio.shape == (6 * SAMPLES_PER_FRAME,)
    assert np.abs(audio).max() > 0


def test_speed_stretches_the_clip(http):
    normal = http.post("/v1/audio/speech", json=speech(response_format="pcm", max_new_tokens=10))
    fast = http.post("/v1/audio/speech", json=speech(response_format="pcm", max_new_tokens=10, speed=2.0, stream=False))
    assert len(pcm_of(fast.content)) == len(pcm_of(normal.content)) // 2
    assert fast.headers["x-usage-output-tokens"] == "10" and fast.headers["x-finish-reason"] == "length"


def test_streamed_audio_equals_non_streamed_audio(http, openai_client):
    body = speech(max_new_tokens=21, seed=99)  # 2 + 4 + 8 + 7: first chunk, ramp, steady, final
    whole = pcm_of(http.post("/v1/audio/speech", json={**body, "response_format": "pcm"}).content)
    assert whole.size == 21 * SAMPLES_PER_FRAME

    raw = []
    with http.stream("POST", "/v1/audio/speech", json={**body, "response_format": "pcm", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
        for piece in r.iter_bytes():
            raw.append(piece)
    np.testing.assert_array_equal(pcm_of(b"".join(raw)), whole)

    # streaming WAV: header with unknown sizes, then the same samples; soundfile reads it
    with http.stream("POST", "/v1/audio/speech", json={**body, "stream": True}) as r:
        wav = b"".join(r.iter_bytes())
    assert wav[:4] == b"RIFF" and wav[4:8] == b"\xff\xff\xff\xff"
    audio, sr = sf.read(io.BytesIO(wav), dtype="int16")
    assert sr == SAMPLE_RATE
    np.testing.assert_array_equal(audio, whole)

    # openai client, stream_format="audio" (raw chunked bytes) and "sse" (base64 deltas + done with usage)
    extra = {k: body[k] for k in ("max_new_tokens", "suppress_eos", "seed")}
    with openai_client.audio.speech.with_streaming_response.create(
        model="cv", voice="vivian", input=body["input"], response_format="pcm", stream_format="audio",
        extra_body=extra,
    ) as response:
        np.testing.assert_array_equal(pcm_of(b"".join(response.iter_bytes())), whole)
    with openai_client.audio.speech.with_streaming_response.create(
        model="cv", voice="vivian", input=body["input"], response_format="pcm", stream_format="sse",
        extra_body=extra,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) == 5 and events[-1]["type"] == "speech.audio.done"  # 21 frames: 1, 2, 4, 8, 6
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["output_tokens"] == 21 and events[-1]["usage"]["input_tokens"] > 0
    np.testing.assert_array_equal(pcm_of(b"".join(base64.b64decode(e["audio"]) for e in deltas)), whole)


def test_first_chunk_size_is_per_request(http):
    with http.stream("POST", "/v1/audio/speech", json=speech(
            response_format="pcm", stream_format="sse", max_new_tokens=9, initial_codec_chunk_frames=1)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    sizes = [len(base64.b64decode(e["audio"])) // 2 // SAMPLES_PER_FRAME for e in events[:-1]]
    assert sizes == [1, 2, 4, 2]


CODE2WAV_HOPS = ["to_code2wav", "code2wav_queue", "code2wav", "from_code2wav"]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("first_frames", [1, 3])
def test_the_response_says_where_its_first_audio_went(http, stream, first_frames):
    """cv's Talker decodes first chunks of up to 2 frames itself (conftest): a 3-frame one goes to Code2Wav."""
    body = speech(response_format="pcm", stream=stream, max_new_tokens=4, initial_codec_chunk_frames=first_frames)
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200
        stages = parse_server_timing(r.headers["server-timing"])
        pcm = r.read()
    assert len(pcm) == 4 * SAMPLES_PER_FRAME * 2
    hops = [name for name in stages if name != "total"]
    by_talker = first_frames == 1
    # every hop of the path stamped its part, in path order (the gRPC transport: the ingress reads the chunks)
    assert hops == ["ingress", "to_talker", "talker_queue", "talker", "talker_decode", "to_ingress",
                    *([] if by_talker else CODE2WAV_HOPS), "respond"]
    assert all(stages[name] >= -0.5 for name in hops), stages  # one machine's clock: no hop runs backwards
    assert stages["talker"] > 0  # the tiny models' work is not free
    assert (stages["talker_decode"] if by_talker else stages["code2wav"]) > 0
    assert sum(stages[name] for name in hops) == pytest.approx(stages["total"], abs=0.01 * len(hops) + 0.01)



def test_code2wav_engine_stats_count_the_chunks_it_decoded(http):
    """`Code2Wav.engine_stats()` (what `bench.replica_stats --seconds N` reads over a window): a 4-frame stream whose
    first chunk is 3 frames (more than cv's Talker decodes itself) reaches Code2Wav, and its counters move."""
    before = code2wav_stats()
    body = speech(response_format="pcm", max_new_tokens=4, initial_codec_chunk_frames=3)
    r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and len(r.content) == 4 * SAMPLES_PER_FRAME * 2
    after = code2wav_stats()
    assert after["batches"] > before["batches"] and after["chunks"] > before["chunks"]
    assert after["new_frames"] - before["new_frames"] >= 3  # at least the first chunk's frames (Code2Wav decoded it)
    assert after["decoded_frames"] - before["decoded_frames"] >= after["new_frames"] - before["new_frames"]
    assert after["busy_s"] > before["busy_s"]

def test_sixteen_concurrent_streams_all_complete(base_url):
    async def one(client, i):
        body = speech(response_format="pcm", stream=True, max_new_tokens=12, seed=i, input=f"Stream number {i}.")
        received = 0
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for piece in r.aiter_bytes():
                received += len(piece)
        return received

    async def run():
        async with httpx.AsyncClient(base_url=base_url, timeout=180) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    sizes = asyncio.run(run())
    assert sizes == [12 * SAMPLES_PER_FRAME * 2] * 16
    # every row given back (the engine releases a finished row on its next iteration)
    wait_for(lambda: engine_stats("cv")["running"] == 0, 60, 0.2, "the rows released")


def test_requests_are_routed_by_model(http, openai_client):
    # work an earlier test left (a dropped stream, a cancelled job) ends first: from here on only this test's moves cv
    wait_for(lambda: all(engine_stats("cv")[k] == 0 for k in ("running", "waiting", "parked", "held")), 120, 0.2,
             "cv idle")
    before = {m: engine_stats(m)["frames"] for m in ("cv", "vd")}
    vd = http.post("/v1/audio/speech", json=speech(model="vd", voice=None, instructions="A bright, young voice.",
                                                   response_format="pcm", max_new_tokens=5))
    assert vd.status_code == 200, vd.text
    assert engine_stats("vd")["frames"] - before["vd"] >= 5
    assert engine_stats("cv")["frames"] == before["cv"]
    # an alias, and the default voice of a CustomVoice model
    alias = openai_client.audio.speech.create(model="tts-1", voice="default", input="Alias.", response_format="pcm",
                                              extra_body={"max_new_tokens": 4, "suppress_eos": True})
    assert len(alias.content) == 4 * SAMPLES_PER_FRAME * 2
    assert engine_stats("cv")["frames"] - before["cv"] >= 4
    # no `model`: a preset speaker only CustomVoice models have
    inferred = http.post("/v1/audio/speech", json={k: v for k, v in speech(response_format="pcm").items()
                                                   if k != "model"})
    assert inferred.status_code == 400 and inferred.json()["error"]["param"] == "model"  # cv and cv-scale both fit


def test_base_model_clones_inline_reference_audio(http, file_server):
    from tests.serve.conftest import wav_bytes

    clip = base64.b64encode(wav_bytes(1.5)).decode()
    body = speech(model="base", voice=None, response_format="pcm", max_new_tokens=5)
    icl = http.post("/v1/audio/speech", json={**body, "ref_audio": f"data:audio/wav;base64,{clip}",
                                              "ref_text": "A reference sentence."})
    assert icl.status_code == 200, icl.text
    assert len(pcm_of(icl.content)) == 5 * SAMPLES_PER_FRAME
    xvec = http.post("/v1/audio/speech", json={**body, "ref_audio": clip, "x_vector_only_mode": True})
    assert xvec.status_code == 200, xvec.text
    fetched = http.post("/v1/audio/speech", json={**body, "ref_audio": f"{file_server}/allowed/clip.wav",
                                                  "x_vector_only_mode": True})
    assert fetched.status_code == 200, fetched.text


def test_replica_stats_summarize_every_replica_since_start(http):
    """`bench.replica_stats` (the scale-out runs' attribution): after a request, the Talker's summary counts its
    steps and batch, and Code2Wav's its chunks and frames, each keyed by the replica that answered."""
    from ray import serve

    from bench.replica_stats import code2wav_summary, every_replica, talker_summary

    body = speech(response_format="pcm", max_new_tokens=5, initial_codec_chunk_frames=3)
    assert http.post("/v1/audio/speech", json=body).status_code == 200

    async def read():
        talkers = await every_replica(serve.get_deployment_handle("Talker:cv", app_name=APP), 1)
        code2wavs = await every_replica(serve.get_deployment_handle("Code2Wav", app_name=APP), 1)
        return talkers, code2wavs

    talkers, code2wavs = asyncio.run(read())
    assert len(talkers) == 1 and len(code2wavs) == 1
    (name, stats), = talkers.items()
    assert stats["replica"] == name
    talker = talker_summary(stats)
    assert talker["steps"] == stats["steps"] >= 5 and talker["admitted"] >= 1
    assert 1 <= talker["mean_batch"] <= stats["max_running"]  # frames per step: the rows it ran
    assert talker["engine_thread_step_ms"] > 0 and 0 <= talker["device_wait_ms"] <= talker["engine_thread_step_ms"]
    code2wav = code2wav_summary(next(iter(code2wavs.values())))
    assert code2wav["chunks"] >= 1 and code2wav["new_frames"] >= 2  # this request's frames after its first chunk
    assert code2wav["decoded_per_new_frame"] >= 1.0  # left context is decoded again, never less than the new frames


def test_one_model_by_name_or_alias(http):
    assert http.get("/v1/models/cv").json()["id"] == "cv"
    by_alias = http.get("/v1/models/TTS-1").json()
    assert by_alias["id"] == "cv" and by_alias["task_type"] == "CustomVoice"
    missing = http.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")


def test_openai_voice_names_speak_with_their_presets(openai_client):
    """Every OpenAI voice name works unchanged, as OpenAI's own examples send it (model tts-1)."""
    from deployments.ingress.voice_aliases import DEFAULT_VOICE_ALIASES

    assert set(DEFAULT_VOICE_ALIASES) == set(OPENAI_VOICES)
    for voice in OPENAI_VOICES:
        response = openai_client.audio.speech.create(
            model="tts-1", voice=voice, input="An OpenAI voice.", response_format="pcm",
            extra_body={"max_new_tokens": 6, "suppress_eos": True, "seed": 7})
        assert len(response.content) == 6 * SAMPLES_PER_FRAME * 2, voice
    # a name no preset or alias has is still refused, naming the field
    with pytest.raises(Exception) as err:
        openai_client.audio.speech.create(model="tts-1", voice="nobody", input="x")
    assert getattr(err.value, "status_code", None) == 400
