"""The application's metrics reach Ray's Prometheus endpoint with Serve's deployment tags."""

from __future__ import annotations

import os
import re

import httpx
import pytest

from tests.serve.conftest import speech, wait_for

pytestmark = pytest.mark.serve

EXPECTED = (
    'ray_tts_requests_total{.*model="cv".*status="ok"',
    'ray_tts_time_to_first_audio_ms_bucket{.*stream="true"',
    'ray_tts_time_to_first_audio_ms_bucket{.*stream="false"',
    "ray_tts_real_time_factor_bucket{",
    "ray_tts_audio_seconds_total{",
    'ray_tts_requests_total{.*status="bad_request"',
    'ray_tts_talker_running{.*deployment="Talker:cv"',
    "ray_tts_talker_waiting{",
    "ray_tts_talker_slots{",
    "ray_tts_talker_kv_usage{",
    "ray_tts_talker_frames_total{",
    "ray_tts_talker_mean_batch_size_bucket{",
    'ray_tts_code2wav_batch_size_bucket{.*deployment="Code2Wav"',
    "ray_tts_code2wav_call_latency_ms_bucket{",
    "ray_tts_code2wav_batch_decode_ms_bucket{",
    "ray_tts_code2wav_queued_chunks{",
    "ray_tts_client_buffer_lead_s_bucket{",
    # the first chunk is decoded by the Talker (first_chunk_decoder.py) or by Code2Wav, whichever is free
    'ray_tts_first_audio_stage_ms_bucket{.*stage="(code2wav|talker_decode)"',
    'ray_tts_batch_items{.*state="completed"',  # store-wide batch job progress (every ingress replica)
)


def test_metrics_are_exported(http):
    assert http.post("/v1/audio/speech", json=speech(response_format="pcm", stream=False)).status_code == 200
    # long enough that Code2Wav decodes chunks after the first (its own metrics)
    with http.stream("POST", "/v1/audio/speech", json=speech(response_format="pcm", stream=True,
                                                             max_new_tokens=40)) as r:
        r.read()
    assert http.post("/v1/audio/speech", json=speech(voice="nobody")).status_code == 400
    url = os.environ["QWEN3_TTS_TEST_METRICS_URL"]

    def missing() -> list[str]:
        text = httpx.get(url, timeout=10).text
        return [p for p in EXPECTED if not re.search(p, text)]

    try:
        wait_for(lambda: not missing(), 60, 1.0, "metrics on the Prometheus endpoint")
    except AssertionError:
        raise AssertionError(f"metrics not exported: {missing()}") from None
