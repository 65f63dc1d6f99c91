"""Audio on the wire: int16 PCM, streaming WAV headers, whole-file encodings, and the `speed` time stretch."""

from __future__ import annotations

import io
import struct

import numpy as np
import soundfile as sf

from stages.contract import SAMPLE_RATE

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
}
STREAMABLE_FORMATS = ("pcm", "wav")
_SOUNDFILE_FORMATS = {  # response_format -> (libsndfile container, subtype)
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
_UNKNOWN_SIZE = 0xFFFFFFFF


def float_to_pcm16(audio: np.ndarray) -> np.ndarray:  # [n] float in [-1, 1] -> [n] int16
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype(np.int16)


def pcm16_to_float(pcm: np.ndarray) -> np.ndarray:  # [n] int16 -> [n] float32
    return pcm.astype(np.float32) / 32767.0


def streaming_wav_header(sample_rate: int = SAMPLE_RATE, channels: int = 1) -> bytes:
    """44-byte PCM16 WAV header whose RIFF and data sizes are 0xFFFFFFFF (length unknown when streaming)."""
    byte_rate = sample_rate * channels * 2
    return (
        b"RIFF" + struct.pack("<I", _UNKNOWN_SIZE) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, byte_rate, channels * 2, 16)
        + b"data" + struct.pack("<I", _UNKNOWN_SIZE)
    )


def encode(pcm: np.ndarray, response_format: str, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A whole clip of int16 PCM -> the bytes of `response_format` (pcm = raw s16le)."""
    if response_format == "pcm":
        return pcm.astype("<i2").tobytes()
    container, subtype = _SOUNDFILE_FORMATS[response_format]
    buf = io.BytesIO()
    sf.write(buf, pcm, sample_rate, format=container, subtype=subtype)
    return buf.getvalue()


def time_stretch(pcm: np.ndarray, speed: float, n_fft: int = 768, hop: int = 192) -> np.ndarray:
    """Pitch-preserving tempo change by `speed` (2.0 = twice as fast): a phase vocoder, int16 in and out.

    The same post-processing vllm-omni applies (STFT n_fft 768); the output has round(len / speed) samples.
    """
    if speed == 1.0 or pcm.size == 0:
        return pcm
    x = pcm16_to_float(pcm)
    window = np.hanning(n_fft + 1)[:-1].astype(np.float32)
    padded = np.pad(x, (n_fft // 2, n_fft // 2 + n_fft))
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop] * window
    spec = np.fft.rfft(frames, axis=1)  # [T, F]
    steps = np.arange(0, spec.shape[0] - 1, speed)
    expected = 2 * np.pi * hop * np.arange(spec.shape[1]) / n_fft
    phase = np.angle(spec[0])
    out = np.empty((len(steps), spec.shape[1]), dtype=np.complex64)
    for i, t in enumerate(steps):
        lo, frac = int(t), t - int(t)
        mag = (1 - frac) * np.abs(spec[lo]) + frac * np.abs(spec[lo + 1])
        out[i] = mag * np.exp(1j * phase)
        delta = np.angle(spec[lo + 1]) - np.angle(spec[lo]) - expected
        phase += expected + (delta - 2 * np.pi * np.round(delta / (2 * np.pi)))
    y = np.zeros(len(steps) * hop + n_fft, dtype=np.float32)
    norm = np.zeros_like(y)
    for i, frame in enumerate(np.fft.irfft(out, n=n_fft, axis=1).astype(np.float32)):
        y[i * hop:i * hop + n_fft] += frame * window
        norm[i * hop:i * hop + n_fft] += window**2
    y = y[n_fft // 2:] / np.maximum(norm[n_fft // 2:], 1e-3)
    n_out = int(round(pcm.size / speed))
    y = np.pad(y, (0, max(0, n_out - y.size)))[:n_out]
    return float_to_pcm16(y)
