"""Reference-audio loading: encoded bytes or (array, sr) -> mono float32 at 24 kHz, as the official wrapper does it."""

from __future__ import annotations

import io
import math

import numpy as np
import soundfile as sf
import soxr

from stages.voice.mel import MIN_SAMPLES

TARGET_SR = 24000
DEFAULT_MAX_SECONDS = 60.0
MIN_SECONDS = MIN_SAMPLES / TARGET_SR  # the speaker encoder's mel front end needs > 384 samples at 24 kHz

AudioInput = bytes | bytearray | memoryview | tuple[np.ndarray, int]


def decode_audio(data: bytes | bytearray | memoryview) -> tuple[np.ndarray, int]:
    """Encoded audio (anything libsndfile reads: wav, flac, ogg/vorbis/opus, mp3, ...) -> ([n] or [n, ch] float32, sr)."""
    if len(data) == 0:
        raise ValueError("reference audio is empty (0 bytes)")
    try:
        audio, sr = sf.read(io.BytesIO(bytes(data)), dtype="float32", always_2d=False)
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ValueError(f"could not decode reference audio ({len(data)} bytes): {e}") from None
    return audio, int(sr)


def to_mono_float32(audio: np.ndarray) -> np.ndarray:  # [n] or [n, channels] -> [n] float32
    """2-D arrays are (samples, channels), as soundfile returns them and as the official wrapper assumes."""
    audio = np.asarray(audio)
    if audio.dtype.kind != "f":
        # The official wrapper would feed int16 PCM values (+-32768) to the model unscaled: reject instead.
        raise ValueError(f"reference audio samples must be floats in [-1, 1], got dtype {audio.dtype}")
    if audio.ndim not in (1, 2):
        raise ValueError(f"reference audio must be 1-D [samples] or 2-D [samples, channels], got shape {audio.shape}")
    audio = audio.astype(np.float32)
    if audio.ndim == 2:
        audio = np.mean(audio, axis=-1).astype(np.float32)  # same op (float32 pairwise mean) as the official code
    return audio


def resample(audio: np.ndarray, orig_sr: int, target_sr: int = TARGET_SR) -> np.ndarray:  # [n] -> [ceil(n * r)]
    """librosa.resample(y, orig_sr, target_sr) with its default res_type 'soxr_hq' and fix=True, bit for bit."""
    if orig_sr == target_sr:
        return audio
    out = soxr.resample(audio, orig_sr, target_sr, quality="soxr_hq")
    n_out = int(np.ceil(audio.shape[-1] * (float(target_sr) / orig_sr)))  # librosa's fix_length target
    if out.shape[-1] < n_out:
        out = np.pad(out, (0, n_out - out.shape[-1]))
    return np.asarray(out[:n_out], dtype=audio.dtype)


def load_reference_audio(source: AudioInput, max_seconds: float | None = DEFAULT_MAX_SECONDS) -> np.ndarray:
    """Encoded bytes, or (waveform, sample_rate) -> [n] float32 mono at 24 kHz.

    Raises ValueError (with a message fit for an HTTP 400) for undecodable, empty, non-finite, too short or
    longer-than-`max_seconds` audio. No loudness normalization: the official pipeline has none.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        audio, sr = decode_audio(source)
    elif isinstance(source, tuple) and len(source) == 2:
        audio, sr = source
        if isinstance(sr, bool) or not isinstance(sr, (int, np.integer)) or sr <= 0:
            raise ValueError(f"sample rate must be a positive integer, got {sr!r}")
        sr = int(sr)
    else:
        raise ValueError(f"reference audio must be encoded bytes or (np.ndarray, sample_rate), got {type(source).__name__}")
    audio = to_mono_float32(audio)
    n = audio.shape[0]
    if n == 0:
        raise ValueError("reference audio is empty (0 samples)")
    seconds = n / sr
    if max_seconds is not None and seconds > max_seconds:
        raise ValueError(f"reference audio is {seconds:.1f} s long; the limit is {max_seconds:g} s")
    if not np.isfinite(audio).all():
        raise ValueError("reference audio contains NaN or infinite samples")
    audio = resample(audio, sr)
    if audio.shape[0] < MIN_SAMPLES:
        raise ValueError(
            f"reference audio is {seconds * 1000:.0f} ms long; at least {math.ceil(MIN_SECONDS * 1000)} ms is needed"
        )
    return audio
