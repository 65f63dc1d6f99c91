"""Wire formats, whole clips: what soundfile reads decodes exactly; WAV headers; the schema lists every format."""

from __future__ import annotations

import io
import typing

import numpy as np
import pytest
import soundfile as sf

from deployments.audio.encoders import encode
from deployments.audio.formats import FORMATS, float_to_pcm16, streaming_wav_header
from deployments.ingress.schemas import ResponseFormat, SpeechRequest

SR = 24000


def _tone(seconds: float = 1.0, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return float_to_pcm16(0.5 * np.sin(2 * np.pi * hz * t))


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_every_container_decodes_to_the_same_rate_and_length(fmt):
    pcm = _tone()
    audio, sr = sf.read(io.BytesIO(encode(pcm, fmt)), dtype="int16")
    assert sr == SR and audio.shape == pcm.shape
    if fmt in ("wav", "flac"):  # lossless
        np.testing.assert_array_equal(audio, pcm)


def test_pcm_is_raw_little_endian_int16():
    pcm = _tone(0.1)
    assert encode(pcm, "pcm") == pcm.astype("<i2").tobytes()


def test_streaming_wav_header_has_unknown_sizes_and_decodes():
    header = streaming_wav_header()
    assert len(header) == 44 and header[4:8] == header[40:44] == b"\xff\xff\xff\xff"
    pcm = _tone(0.5)
    audio, sr = sf.read(io.BytesIO(header + pcm.tobytes()), dtype="int16")
    assert sr == SR
    np.testing.assert_array_equal(audio, pcm)


def test_whole_wav_has_real_sizes():
    pcm = _tone(0.25)
    data = encode(pcm, "wav")
    assert int.from_bytes(data[40:44], "little") == pcm.size * 2 and int.from_bytes(data[4:8], "little") == len(data) - 8


@pytest.mark.parametrize("fmt", ["mp3", "opus", "flac"])
def test_whole_clip_at_speed_keeps_the_stretched_length(fmt):
    audio, sr = sf.read(io.BytesIO(encode(_tone(), fmt, speed=2.0)), dtype="int16")
    assert sr == SR and audio.size == SR // 2  # seekable output: gapless MP3 tag, exact Ogg / FLAC lengths


def test_the_schema_accepts_exactly_the_encoded_formats():
    assert set(typing.get_args(ResponseFormat)) == set(FORMATS)
    assert SpeechRequest(input="x", response_format="g711_ulaw").response_format == "mulaw"


def test_float_to_pcm16_clips():
    np.testing.assert_array_equal(float_to_pcm16(np.array([-2.0, 0.0, 2.0])), [-32767, 0, 32767])
