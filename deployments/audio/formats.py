"""Audio on the wire: the response formats (media types, codecs), int16 PCM and the WAV header.

The encoders themselves are in `deployments/audio/encoders.py`."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

from stages.contract import SAMPLE_RATE


@dataclass(frozen=True)
class AudioFormat:
    media_type: str
    muxer: str | None = None  # FFmpeg muxer; None: raw s16le written here (pcm, wav)
    codec: str | None = None
    sample_rate: int | None = None  # encoded rate; None: the model's (24 kHz)
    bit_rate: int | None = None
    muxer_options: dict[str, str] = field(default_factory=dict)
    codec_options: dict[str, str] = field(default_factory=dict)


FORMATS = {
    "pcm": AudioFormat("audio/pcm"),
    "wav": AudioFormat("audio/wav"),
    "mp3": AudioFormat("audio/mpeg", "mp3", "libmp3lame", bit_rate=64_000),
    # an Ogg page is written once the next one starts: 40 ms pages hold back 40 ms per push, at ~5 kbit/s
    # of page headers (FFmpeg's default, 1 s pages, would hold back a second)
    "opus": AudioFormat("audio/ogg", "ogg", "libopus", bit_rate=32_000, muxer_options={"page_duration": "40000"}),
    "aac": AudioFormat("audio/aac", "adts", "aac", bit_rate=64_000),
    # 80 ms blocks (one codec frame) instead of FFmpeg's ~100 ms: whole chunks leave with their push
    "flac": AudioFormat("audio/flac", "flac", "flac", codec_options={"frame_size": "1920"}),
    # G.711 telephony: headerless 8-bit, 8 kHz (FFmpeg's resampler inside the encoder, stateful across pushes)
    "mulaw": AudioFormat("audio/basic", "mulaw", "pcm_mulaw", sample_rate=8000),
    "alaw": AudioFormat("audio/x-alaw-basic", "alaw", "pcm_alaw", sample_rate=8000),
}
MEDIA_TYPES = {name: f.media_type for name, f in FORMATS.items()}
_UNKNOWN_SIZE = 0xFFFFFFFF


def float_to_pcm16(audio: np.ndarray) -> np.ndarray:  # [n] float in [-1, 1] -> [n] int16
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype(np.int16)


def streaming_wav_header(sample_rate: int = SAMPLE_RATE, channels: int = 1, data_bytes: int | None = None) -> bytes:
    """44-byte PCM16 WAV header; its RIFF and data sizes are 0xFFFFFFFF when the length is unknown (streaming)."""
    byte_rate = sample_rate * channels * 2
    riff = _UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN_SIZE if data_bytes is None else data_bytes
    return (
        b"RIFF" + struct.pack("<I", riff) + b"WAVE"
        + b"fmt " + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, byte_rate, channels * 2, 16)
        + b"data" + struct.pack("<I", data)
    )
