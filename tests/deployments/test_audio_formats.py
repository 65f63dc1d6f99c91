"""Wire formats: every response_format decodes with soundfile; streaming WAV header; the speed stretch."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from deployments.audio_formats import encode, float_to_pcm16, streaming_wav_header, time_stretch

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


@pytest.mark.parametrize("speed", [0.5, 1.25, 2.0, 4.0])
def test_time_stretch_changes_length_not_pitch(speed):
    pcm = _tone(1.0, 440.0)
    out = time_stretch(pcm, speed)
    assert out.dtype == np.int16 and out.size == round(pcm.size / speed)
    spectrum = np.abs(np.fft.rfft(out.astype(np.float64)))
    assert abs(np.argmax(spectrum) * SR / out.size - 440.0) < 5.0


def test_float_to_pcm16_clips():
    np.testing.assert_array_equal(float_to_pcm16(np.array([-2.0, 0.0, 2.0])), [-32767, 0, 32767])
