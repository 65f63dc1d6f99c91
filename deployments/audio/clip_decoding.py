"""Reference clips that libsndfile cannot read (what browsers and phones record: webm/opus, m4a/aac, ...) decoded
with PyAV into a WAV that it can.

The container is recognised by its first bytes and opened with that one demuxer, never by FFmpeg's probing: a
probed "clip" could be a playlist or a concat list that makes FFmpeg open other files. Decoding stops past the
duration limit, so a small file that decodes to hours costs no more than the limit.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

# first bytes -> the FFmpeg demuxer of that container
_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x1a\x45\xdf\xa3", "matroska"),  # webm, mkv (opus, vorbis)
    (0, b"OggS", "ogg"),  # opus, vorbis
    (4, b"ftyp", "mov"),  # m4a, mp4, 3gp (aac, alac); external data references stay off (mov's enable_drefs)
    (0, b"RIFF", "wav"),
    (0, b"fLaC", "flac"),
    (0, b"ID3", "mp3"),
)


def container_of(data: bytes) -> str | None:
    """The demuxer for `data`, or None when it is no container this server reads."""
    for offset, magic, demuxer in _MAGIC:
        if data[offset:offset + len(magic)] == magic:
            return demuxer
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xF6 == 0xF0:  # ADTS: a raw AAC stream
        return "aac"
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:  # an MPEG audio frame
        return "mp3"
    return None


def decode_to_wav(data: bytes, max_seconds: float) -> bytes | None:
    """`data` as a mono 16-bit WAV at its own sample rate; at most a little over `max_seconds` of it (the caller's
    duration check sees that it is too long). None when it is not audio this server reads."""
    import av

    demuxer = container_of(data)
    if demuxer is None:
        return None
    try:
        with av.open(io.BytesIO(data), mode="r", format=demuxer) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None or not stream.rate:
                return None
            rate = int(stream.rate)
            resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
            pieces, samples, limit = [], 0, int((max_seconds + 1) * rate)
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    pcm = out.to_ndarray().reshape(-1)
                    pieces.append(pcm)
                    samples += pcm.size
                if samples > limit:
                    break
            else:
                for out in resampler.resample(None):
                    pieces.append(out.to_ndarray().reshape(-1))
    except (av.FFmpegError, ValueError, IndexError, EOFError, OSError):
        return None
    if not pieces:
        return None
    buf = io.BytesIO()
    sf.write(buf, np.concatenate(pieces).astype(np.int16), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()
