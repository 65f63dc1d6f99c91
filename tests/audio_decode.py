"""Decoding the served formats with PyAV (FFmpeg), for the tests: the same libraries a client would use."""

from __future__ import annotations

import io

import av
import numpy as np

from deployments.audio.formats import FORMATS

SR = 24000
RAW = {"pcm": ("s16le", SR), "mulaw": ("mulaw", 8000), "alaw": ("alaw", 8000)}  # headerless: demuxer, rate


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """-> (mono float32 in [-1, 1] samples, decoded sample rate), read by FFmpeg's demuxer + decoder."""
    demuxer, rate = RAW.get(fmt, (None, None))
    options = {"sample_rate": str(rate)} if rate else {}
    with av.open(io.BytesIO(data), "r", format=demuxer, options=options) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        rate = stream.codec_context.sample_rate
    audio = np.concatenate(frames) if frames else np.zeros(0, np.float32)
    if audio.dtype == np.int16:  # PCM-like decoders give s16, the lossy ones float
        audio = audio.astype(np.float32) / 32768.0
    return audio.astype(np.float32), rate


def expected_rate(fmt: str) -> int:
    return 48000 if fmt == "opus" else FORMATS[fmt].sample_rate or SR  # FFmpeg decodes all Opus at 48 kHz


def recorded_clip(seconds: float, container: str, codec: str, rate: int = 48000, seed: int = 0) -> bytes:
    """A clip as a browser or phone records it (webm/opus: MediaRecorder; m4a/aac: phones), encoded by PyAV from
    the tests' reference chirp."""
    from tests.conftest import reference_clip

    pcm = (reference_clip(seconds, rate, seed=seed) * 32767).astype(np.int16)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        for start in range(0, pcm.size, 960):
            frame = av.AudioFrame.from_ndarray(pcm[None, start:start + 960], format="s16", layout="mono")
            frame.sample_rate = rate
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


RECORDED = {"webm": ("webm", "libopus"), "m4a": ("ipod", "aac"), "ogg": ("ogg", "libopus"), "mp3": ("mp3", "libmp3lame")}
