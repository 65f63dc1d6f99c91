"""`speed`: a pitch-preserving tempo change that streams, FFmpeg's `atempo` filter run through PyAV.

Chunks go in as they come; out comes the stretched audio the filter has ready. `atempo` fills an output
buffer sized for each input frame before passing it on, so a whole chunk pushed at once would come out only
when the next chunk arrives: the chunk is fed in 20 ms frames, which bounds that lag to a few frames.
`bench/time_stretch_compare.py` compares it with the phase vocoder it replaced (`docs/benchmarks.md`).
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
from av.filter import Graph

FEED_SAMPLES = 480  # 20 ms at 24 kHz: how much `atempo` gets per push (its output lag is about one of these)
MIN_FACTOR, MAX_FACTOR = 0.5, 2.0  # one `atempo` stays within this range: outside it, it skips or repeats audio


def atempo_factors(speed: float) -> list[float]:
    """`speed` as a product of factors in [0.5, 2] (FFmpeg's advice for tempos beyond that range)."""
    factors = []
    while speed > MAX_FACTOR:
        factors.append(MAX_FACTOR)
        speed /= MAX_FACTOR
    while speed < MIN_FACTOR:
        factors.append(MIN_FACTOR)
        speed /= MIN_FACTOR
    return [*factors, speed]


class Tempo:
    """int16 mono chunks in, the same audio `speed` times faster out; exactly round(n / speed) samples in all."""

    def __init__(self, speed: float, sample_rate: int):
        self.speed, self.sample_rate = speed, sample_rate
        self._graph = Graph()
        self._source = self._graph.add_abuffer(format="s16", sample_rate=sample_rate, layout="mono",
                                               time_base=Fraction(1, sample_rate))
        node = self._source
        for factor in atempo_factors(speed):
            stage = self._graph.add("atempo", tempo=repr(factor))
            node.link_to(stage)
            node = stage
        self._sink = self._graph.add("abuffersink")
        node.link_to(self._sink)
        self._graph.configure()
        self._samples_in = self._samples_out = 0

    def push(self, pcm: np.ndarray) -> np.ndarray:
        out = []
        for start in range(0, pcm.size, FEED_SAMPLES):
            self._feed(pcm[start:start + FEED_SAMPLES])
            out.extend(self._drain())
        return self._emit(out)

    def finish(self) -> np.ndarray:
        """The rest, cut or padded to the exact length: `atempo` drops its last partial window at EOF, so
        a window of silence goes in first to carry the real tail out."""
        target = round(self._samples_in / self.speed)
        silence = np.zeros(self.sample_rate // 10, dtype=np.int16)  # 100 ms, more than a window (~42 ms)
        out = []
        for start in range(0, silence.size, FEED_SAMPLES):
            self._feed(silence[start:start + FEED_SAMPLES])
            out.extend(self._drain())
        self._source.push(None)
        out.extend(self._drain())
        rest = np.concatenate([np.zeros(0, np.int16), *out])
        take = max(0, target - self._samples_out)
        tail = np.pad(rest[:take], (0, max(0, take - rest.size)))
        self._samples_out += tail.size
        return tail

    def _feed(self, piece: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(piece, dtype=np.int16)[None], format="s16",
                                           layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = self.sample_rate, self._samples_in, Fraction(1, self.sample_rate)
        self._samples_in += piece.size
        self._source.push(frame)

    def _drain(self) -> list[np.ndarray]:
        out = []
        while True:
            try:
                out.append(self._sink.pull().to_ndarray()[0])
            except (av.BlockingIOError, av.EOFError):  # nothing more yet / ever
                return out

    def _emit(self, pieces: list[np.ndarray]) -> np.ndarray:
        out = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int16)
        self._samples_out += out.size
        return out
