"""Incremental encoders, one per `response_format`: PCM chunks in, the bytes the container has ready out.

`open_stream_encoder(fmt, speed=...)` -> `push(chunk) -> bytes`, `finish() -> bytes`; the pushed pieces
concatenated form a valid stream of that format. The encoded formats run on PyAV (FFmpeg's libraries):
its codec contexts keep their state between pushes (no restart, so no click, at a chunk boundary) and cut
the audio into the codec's frame size themselves. `encode()` (a whole clip) goes through the same encoder,
only into a seekable buffer, so FFmpeg finishes the headers a stream cannot have (FLAC's length, MP3's
gapless tag).
"""

from __future__ import annotations

import asyncio
import io

import numpy as np

from deployments.audio.formats import FORMATS, AudioFormat, float_to_pcm16, streaming_wav_header
from stages.contract import SAMPLE_RATE

# PyAV (FFmpeg's libraries) is imported where an encoded format or `speed` needs it: pcm and wav, the formats
# of the hot path, never load FFmpeg.


def as_pcm16(pcm: np.ndarray) -> np.ndarray:
    """int16 as it is (what Code2Wav sends); float in [-1, 1] scaled and clipped."""
    return pcm if pcm.dtype == np.int16 else float_to_pcm16(pcm)


class StreamEncoder:
    """push / finish, with the optional `speed` stretch in front of the format's own encoding."""

    def __init__(self, sample_rate: int, speed: float):
        self.sample_rate = sample_rate
        self._tempo = None
        if speed != 1.0:
            from deployments.audio.tempo import Tempo

            self._tempo = Tempo(speed, sample_rate)

    def push(self, pcm: np.ndarray) -> bytes:
        pcm = as_pcm16(np.asarray(pcm).reshape(-1))
        return self._encode(self._tempo.push(pcm) if self._tempo else pcm)

    def finish(self) -> bytes:
        tail = self._encode(self._tempo.finish()) if self._tempo else b""
        return tail + self._close()

    def _encode(self, pcm: np.ndarray) -> bytes:
        raise NotImplementedError

    def _close(self) -> bytes:
        raise NotImplementedError


class RawEncoder(StreamEncoder):
    """pcm (s16le) and wav (the header, then s16le): nothing to encode, so no FFmpeg on the hot path."""

    def __init__(self, sample_rate: int, speed: float, wav: bool):
        super().__init__(sample_rate, speed)
        self._header = streaming_wav_header(sample_rate) if wav else b""

    def _encode(self, pcm: np.ndarray) -> bytes:
        data, self._header = self._header + pcm.astype("<i2").tobytes(), b""
        return data

    def _close(self) -> bytes:
        data, self._header = self._header, b""  # a stream with no audio still gets its header
        return data


class _Collector:
    """A write-only file for FFmpeg: no `seek`, so muxers write a stream (nothing patched afterwards)."""

    def __init__(self):
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data


class FFmpegEncoder(StreamEncoder):
    """One PyAV output container + audio stream; int16 frames go in, muxed bytes come out per push."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, speed: float, seekable: bool = False, file=None):
        """`file`: a seekable binary file the muxer writes itself (push and finish return nothing)."""
        import av

        super().__init__(sample_rate, speed)
        self._av = av
        self._own_file = file is None
        self._file = file if file is not None else io.BytesIO() if seekable else _Collector()
        self._container = av.open(self._file, "w", format=fmt.muxer, options=fmt.muxer_options)
        self._stream = self._container.add_stream(fmt.codec, rate=fmt.sample_rate or sample_rate, layout="mono",
                                                  options=fmt.codec_options)
        if fmt.bit_rate:
            self._stream.bit_rate = fmt.bit_rate
        self._open = True

    def _encode(self, pcm: np.ndarray) -> bytes:
        if pcm.size:
            frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm)[None], format="s16", layout="mono")
            frame.sample_rate = self.sample_rate  # PyAV resamples to the codec's rate and format if they differ
            self._container.mux(self._stream.encode(frame))
        return self._take()

    def _close(self) -> bytes:
        self._container.mux(self._stream.encode(None))  # flush the codec (and PyAV's resampler)
        self._container.close()  # trailer
        self._open = False
        return self._take()

    def _take(self) -> bytes:
        if isinstance(self._file, _Collector):
            return self._file.take()
        if not self._own_file:
            return b""  # in the caller's file already
        return b"" if self._open else self._file.getvalue()  # seekable: the file is final only once closed

    def abandon(self) -> None:
        """Close the container of a clip that will not be finished (its file is thrown away)."""
        if self._open:
            self._open = False
            try:
                self._container.close()
            except Exception:  # an unfinished stream may fail to write its trailer: it is discarded anyway
                pass


def open_stream_encoder(fmt: str, sample_rate: int = SAMPLE_RATE, speed: float = 1.0) -> StreamEncoder:
    """An encoder for one stream of `fmt` (a key of FORMATS) at `speed` (1.0 = as generated)."""
    return _open(fmt, sample_rate, speed, seekable=False)


class AsyncStreamEncoder:
    """A stream encoder for an event loop: FFmpeg's work (and a time-stretch) runs in a thread, so one stream's
    encoding never stalls the others; raw pcm/wav at speed 1 costs nothing and runs inline."""

    def __init__(self, fmt: str, speed: float = 1.0):
        self._encoder = open_stream_encoder(fmt, speed=speed)
        self._inline = fmt in ("pcm", "wav") and speed == 1.0

    async def push(self, pcm: np.ndarray) -> bytes:
        return self._encoder.push(pcm) if self._inline else await asyncio.to_thread(self._encoder.push, pcm)

    async def finish(self) -> bytes:
        return self._encoder.finish() if self._inline else await asyncio.to_thread(self._encoder.finish)


class FileEncoder:
    """A whole clip of `fmt` into a seekable binary file, chunk by chunk (never the clip in memory), as `encode()`
    makes it: FFmpeg's muxer seeks back for the headers a stream cannot have, a WAV gets its real sizes. Blocking
    (call it in a thread)."""

    def __init__(self, fmt: str, file, speed: float = 1.0, sample_rate: int = SAMPLE_RATE):
        spec = FORMATS[fmt]
        self._file, self._wav, self._sample_rate = file, fmt == "wav", sample_rate
        self._encoder = (RawEncoder(sample_rate, speed, wav=self._wav) if spec.muxer is None
                         else FFmpegEncoder(spec, sample_rate, speed, file=file))

    def push(self, pcm: np.ndarray) -> None:
        self._file.write(self._encoder.push(pcm))

    def finish(self) -> None:
        self._file.write(self._encoder.finish())
        if self._wav:
            end = self._file.tell()
            self._file.seek(0)
            self._file.write(streaming_wav_header(self._sample_rate, data_bytes=end - 44))
            self._file.seek(end)

    def abandon(self) -> None:
        if isinstance(self._encoder, FFmpegEncoder):
            self._encoder.abandon()


def encode(pcm: np.ndarray, response_format: str, sample_rate: int = SAMPLE_RATE, speed: float = 1.0) -> bytes:
    """A whole clip -> the bytes of `response_format`, through the same encoder as a stream."""
    encoder = _open(response_format, sample_rate, speed, seekable=True)
    data = encoder.push(pcm) + encoder.finish()
    if response_format == "wav":  # the length is known: real sizes instead of the streaming 0xFFFFFFFF
        data = streaming_wav_header(sample_rate, data_bytes=len(data) - 44) + data[44:]
    return data


def _open(fmt: str, sample_rate: int, speed: float, seekable: bool) -> StreamEncoder:
    spec = FORMATS[fmt]
    if spec.muxer is None:
        return RawEncoder(sample_rate, speed, wav=fmt == "wav")
    return FFmpegEncoder(spec, sample_rate, speed, seekable=seekable)


def check_codecs() -> None:
    """Fail now, naming what is missing, when PyAV or one of FORMATS' FFmpeg encoders is absent: a replica started
    without them would answer every mp3/opus/aac/flac/G.711 request (OpenAI's default format included) with a
    500 or a cut stream."""
    try:
        import av
    except ImportError as exc:
        raise RuntimeError("PyAV (`pip install av`) is required: it encodes every response_format but pcm and "
                           f"wav ({exc})") from None
    missing = []
    for name, spec in FORMATS.items():
        if spec.codec is None:
            continue
        try:
            av.codec.Codec(spec.codec, "w")
        except Exception:
            missing.append(f"{name} ({spec.codec})")
    if missing:
        raise RuntimeError(f"this FFmpeg (PyAV {av.__version__}) lacks the encoders of {', '.join(missing)}")
