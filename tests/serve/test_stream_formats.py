"""Every response_format streams through the real app: the openai client's streaming call, SSE, `speed`."""

from __future__ import annotations

import base64
import json

import pytest

from deployments.audio.formats import FORMATS, MEDIA_TYPES
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.audio_decode import decode, expected_rate
from tests.serve.conftest import speech

pytestmark = pytest.mark.serve

FRAMES = 10  # 2 + 4 + 4 with the tests' schedule: three chunks, so chunk boundaries are crossed
SLACK = {"mp3": SAMPLES_PER_FRAME, "aac": SAMPLES_PER_FRAME}  # priming / padding ADTS and streamed MP3 cannot trim
EXTRA = {"max_new_tokens": FRAMES, "suppress_eos": True, "seed": 5}


def assert_duration(data: bytes, fmt: str, samples_at_24k: int) -> None:
    audio, rate = decode(data, fmt)
    want = samples_at_24k * rate // SAMPLE_RATE
    assert rate == expected_rate(fmt)
    assert want <= audio.size <= want + SLACK.get(fmt, 0) * rate // SAMPLE_RATE
    assert abs(audio).max() > 0


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_openai_client_streams_every_format(openai_client, fmt):
    with openai_client.audio.speech.with_streaming_response.create(
        model="cv", voice="vivian", input="Every format streams.", response_format=fmt, stream_format="audio",
        extra_body=EXTRA,
    ) as response:
        assert response.headers["content-type"] == MEDIA_TYPES[fmt]
        data = b"".join(response.iter_bytes())
    assert_duration(data, fmt, FRAMES * SAMPLES_PER_FRAME)


@pytest.mark.parametrize("fmt", ["aac", "mulaw", "alaw"])
def test_new_formats_also_come_whole(http, fmt):
    response = http.post("/v1/audio/speech", json=speech(response_format=fmt, **EXTRA))
    assert response.status_code == 200 and response.headers["content-type"] == MEDIA_TYPES[fmt]
    assert_duration(response.content, fmt, FRAMES * SAMPLES_PER_FRAME)


def test_sse_streams_an_encoded_format_at_speed(http):
    """SSE deltas of a codec's bytes, stretched while streaming: the deltas join into one MP3 at 1/speed."""
    body = speech(response_format="mp3", stream_format="sse", speed=2.0, **EXTRA)
    deltas, done = [], None
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.delta":
                    deltas.append(base64.b64decode(event["audio"]))
                elif event["type"] == "speech.audio.done":
                    done = event
    assert done is not None and done["usage"]["output_tokens"] == FRAMES
    assert_duration(b"".join(deltas), "mp3", round(FRAMES * SAMPLES_PER_FRAME / 2.0))
