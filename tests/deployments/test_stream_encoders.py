"""Every response_format streams: chunks pushed as Code2Wav sends them decode (PyAV) to the right rate and
duration, leave as they are pushed, and meet without clicks; `speed` streams too."""

from __future__ import annotations

import av
import numpy as np
import pytest

from deployments.audio.encoders import encode, open_stream_encoder
from deployments.audio.formats import FORMATS, float_to_pcm16
from tests.audio_decode import RAW, decode, expected_rate

SR = 24000
FRAME = 1920  # samples per codec frame (80 ms): chunks are whole frames
CODEC_SLACK = FRAME  # lossy codecs add their priming / padding (ADTS and headerless MP3 cannot say how much)
LOSSLESS = ("pcm", "wav", "flac")


def signal(seconds: float = 3.0) -> np.ndarray:
    """Voiced-speech-like and click-free: a gliding 140-180 Hz tone with 3 harmonics, faded in and out."""
    t = np.arange(int(seconds * SR)) / SR
    phase = 2 * np.pi * np.cumsum(160 + 20 * np.sin(2 * np.pi * 0.7 * t)) / SR
    wave = sum(a * np.sin(k * phase) for k, a in ((1, 0.4), (2, 0.2), (3, 0.1)))
    return float_to_pcm16(wave * np.minimum(1, np.minimum(t, t[-1] - t) / 0.05))


def chunks_of(pcm: np.ndarray, frames: int) -> list[np.ndarray]:
    return [pcm[i:i + frames * FRAME] for i in range(0, pcm.size, frames * FRAME)]


def decoded_seconds(data: bytes, fmt: str) -> float:
    """Duration of what a player could play from `data` so far (0 before the first decodable packet)."""
    try:
        audio, rate = decode(data, fmt)
    except (av.error.EOFError, av.error.InvalidDataError):
        return 0.0
    return audio.size / rate


def stream(fmt: str, pcm: np.ndarray, frames: int, speed: float = 1.0) -> list[bytes]:
    encoder = open_stream_encoder(fmt, speed=speed)
    return [encoder.push(c) for c in chunks_of(pcm, frames)] + [encoder.finish()]


@pytest.mark.parametrize("frames", [2, 4, 8, 16, 25])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_streamed_bytes_decode_to_the_right_rate_and_duration(fmt, frames):
    pcm = signal()
    audio, rate = decode(b"".join(stream(fmt, pcm, frames)), fmt)
    assert rate == expected_rate(fmt)
    want = pcm.size * rate // SR
    slack = 0 if fmt in LOSSLESS + ("mulaw", "alaw", "opus") else CODEC_SLACK  # Ogg trims Opus exactly
    assert want <= audio.size <= want + slack
    if fmt in LOSSLESS:
        np.testing.assert_array_equal(np.round(audio * 32768).astype(np.int16), pcm)


def test_opus_header_keeps_the_input_rate():
    data = b"".join(stream("opus", signal(0.5), 4))
    head = data.index(b"OpusHead")
    assert int.from_bytes(data[head + 12:head + 16], "little") == SR  # OpusHead's input sample rate


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_audio_leaves_as_it_is_pushed(fmt):
    """After each push, the bytes so far decode to nearly everything pushed: no format waits for the end."""
    pcm, pushed, data = signal(), 0, b""
    encoder = open_stream_encoder(fmt)
    for chunk in chunks_of(pcm, 4):
        data += encoder.push(chunk)
        pushed += chunk.size
        held_back_s = pushed / SR - decoded_seconds(data, fmt)
        assert held_back_s < 0.2, f"{held_back_s:.3f} s held back after {pushed / SR:.2f} s pushed"


def boundary_steps(audio: np.ndarray, boundaries: np.ndarray) -> tuple[float, float]:
    """(largest sample step at the chunk boundaries, largest step anywhere else)."""
    steps = np.abs(np.diff(audio))
    near = np.zeros(steps.size, bool)
    for b in boundaries:
        near[max(0, b - 3):b + 2] = True
    return float(steps[near].max()), float(steps[~near].max())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_chunk_boundaries_make_no_clicks(fmt):
    """The decoded stream steps no further where chunks meet than anywhere else in the signal."""
    pcm = signal()
    audio, rate = decode(b"".join(stream(fmt, pcm, 2)), fmt)
    reference = pcm.astype(np.float32) / 32768.0
    if rate != SR:  # compare at the decoded rate
        import soxr

        reference = soxr.resample(reference, SR, rate)
    # lossy decoders lead with their priming samples: align on the cross-correlation peak
    lag = int(np.argmax(np.correlate(audio[:rate // 2 + 4096], reference[:rate // 2], "valid"))) if fmt not in RAW else 0
    boundaries = lag + np.arange(2 * FRAME, pcm.size, 2 * FRAME) * rate // SR
    at_boundaries, elsewhere = boundary_steps(audio, boundaries[boundaries < audio.size - 2])
    own_range = float(np.abs(np.diff(reference)).max())
    assert at_boundaries <= elsewhere
    assert at_boundaries <= (1.0 if fmt in LOSSLESS else 1.5) * own_range + 1e-6


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "aac", "flac", "mulaw"])
@pytest.mark.parametrize("speed", [0.5, 1.5, 2.0, 4.0])
def test_speed_streams(fmt, speed):
    pcm = signal()
    audio, rate = decode(b"".join(stream(fmt, pcm, 4, speed)), fmt)
    want = round(pcm.size / speed) * rate // SR
    slack = {"mp3": CODEC_SLACK, "aac": CODEC_SLACK}.get(fmt, 0)
    assert want <= audio.size <= want + slack
    # pitch kept: the strongest partial stays at ~160 Hz (a resampling "speed" would move it to 160 x speed)
    spectrum = np.abs(np.fft.rfft(audio * np.hanning(audio.size)))
    assert abs(np.argmax(spectrum) * rate / audio.size - 160.0) < 20.0


@pytest.mark.parametrize("speed", [0.5, 1.25, 2.0])
def test_stretch_is_the_same_streamed_or_whole_and_click_free(speed):
    pcm = signal()
    streamed = np.frombuffer(b"".join(stream("pcm", pcm, 2, speed)), "<i2")
    np.testing.assert_array_equal(streamed, np.frombuffer(encode(pcm, "pcm", speed=speed), "<i2"))
    assert streamed.size == round(pcm.size / speed)
    own_range = np.abs(np.diff(pcm.astype(np.int32))).max()
    assert np.abs(np.diff(streamed.astype(np.int32))).max() <= 1.5 * own_range


@pytest.mark.parametrize("fmt", ["mulaw", "alaw"])
def test_telephony_resampling_filters_what_8khz_cannot_carry(fmt):
    """6 kHz is above 8 kHz audio's 4 kHz limit: it must be filtered out, not folded down to 2 kHz."""
    t = np.arange(SR) / SR
    level = {}
    for hz in (1000, 6000):
        audio, _ = decode(encode(float_to_pcm16(0.5 * np.sin(2 * np.pi * hz * t)), fmt), fmt)
        level[hz] = np.sqrt(np.mean(audio[800:-800] ** 2))
    assert level[1000] > 0.3 and level[6000] < 0.01 * level[1000]


def test_float_and_int16_chunks_encode_alike():
    pcm = signal(0.5)
    as_float = open_stream_encoder("flac")
    as_int = open_stream_encoder("flac")
    a = as_float.push(pcm.astype(np.float32) / 32767.0) + as_float.finish()
    b = as_int.push(pcm) + as_int.finish()
    assert a == b


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_stream_with_no_audio_still_finishes(fmt):
    """A request that ends at its first frame (EOS) sends no PCM: finish() must not fail."""
    data = open_stream_encoder(fmt).finish()
    assert isinstance(data, bytes)
