"""Cutting a stream of codec frames into CodecChunks with left context: the streaming schedule both stages
share (the Talker engine cuts chunks with it, Code2Wav decodes them).

A stream's chunks: the first is small (time to first audio), the next ones grow (the ramp) up to the
steady size, and the rest of the stream is flushed as one final partial chunk. Every chunk carries the
last `left_context_frames` frames before it (already played out) as left context: the decoder is causal,
so context only conditions the new frames, and Code2Wav returns only the new frames' samples. Base ICL
requests count the reference codes as frames before the stream (as the official decode does, which
decodes `cat(ref_codes, generated)` and cuts the reference's samples), so even the first chunk has
context. `docs/code2wav.md` has the fidelity measurements behind the default context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stages.code2wav.config import DecoderConfig
from stages.contract import CODEBOOK_SIZE, NUM_CODEBOOKS, CodecChunk, FinishReason

DEFAULT_LEFT_CONTEXT_FRAMES = 25  # see docs/code2wav.md (fidelity vs cost study)


@dataclass(frozen=True)
class ChunkSchedule:
    """Sizes (in frames, 80 ms each) of a stream's chunks and of their left context.

    Chunk 0 has `first_chunk_frames` new frames. Chunks 1.. follow the ramp, then `steady_chunk_frames`:
    - `ramp=None` (default): geometric, each chunk `ceil(previous * ramp_factor)` frames, capped at steady
      (2, 4, 8, 16, 25, 25, ... with the defaults);
    - `ramp=(a, b, ...)`: chunks 1, 2, ... have exactly a, b, ... frames, then steady (`()`: no ramp).
    A growing ramp plays out without gaps only while the talker produces frames faster than real time
    by about the growth factor (2x for doubling; docs/code2wav.md).

    `left_context_frames`: frames before a chunk decoded again as its context (0 = none; cost
    (context + new) / new). `ref_context_frames`: at most this many reference frames (Base ICL) as
    context of chunk 0; None = `left_context_frames`. Later chunks take their context from the reference
    and the generated frames alike, up to `left_context_frames`.
    """

    first_chunk_frames: int = 2
    steady_chunk_frames: int = 25
    left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES
    ramp_factor: float = 2.0
    ramp: tuple[int, ...] | None = None
    ref_context_frames: int | None = None

    def __post_init__(self) -> None:
        if self.ramp is not None and not isinstance(self.ramp, tuple):
            object.__setattr__(self, "ramp", tuple(self.ramp))  # lists from YAML/JSON
        if self.first_chunk_frames < 1 or self.steady_chunk_frames < 1:
            raise ValueError("first_chunk_frames and steady_chunk_frames must be >= 1")
        if self.left_context_frames < 0:
            raise ValueError("left_context_frames must be >= 0")
        if self.ref_context_frames is not None and self.ref_context_frames < 0:
            raise ValueError("ref_context_frames must be >= 0 (or None: left_context_frames)")
        if self.ramp is None and not self.ramp_factor > 1.0:
            raise ValueError("ramp_factor must be > 1 (use ramp=() for no ramp)")
        if self.ramp is not None and any(int(n) != n or n < 1 for n in self.ramp):
            raise ValueError(f"ramp sizes must be integers >= 1, got {self.ramp}")

    @property
    def ref_context(self) -> int:
        return self.left_context_frames if self.ref_context_frames is None else self.ref_context_frames

    def chunk_frames(self, index: int) -> int:
        """New frames of chunk `index` (0-based) of a stream, the final partial chunk aside."""
        if index == 0:
            return self.first_chunk_frames
        if self.ramp is not None:
            return int(self.ramp[index - 1]) if index <= len(self.ramp) else self.steady_chunk_frames
        n = self.first_chunk_frames
        for _ in range(index):
            if n >= self.steady_chunk_frames:
                return self.steady_chunk_frames
            n = min(self.steady_chunk_frames, math.ceil(n * self.ramp_factor))
        return n

    def plan(self, total_frames: int, ref_frames: int = 0) -> list[tuple[int, int]]:
        """(context, new) of every chunk of a stream of `total_frames` frames, as `StreamChunker` cuts it.

        The last entry is the final chunk: the frames left after the last full chunk, possibly none
        (a stream that ends on a chunk boundary, or has no frames, ends with an empty final chunk).
        """
        out: list[tuple[int, int]] = []
        done, i = 0, 0
        while True:
            n = self.chunk_frames(i)
            final = done + n > total_frames
            if final:
                n = total_frames - done
            ctx = min(self.ref_context if done == 0 else self.left_context_frames, done + ref_frames) if n else 0
            out.append((ctx, n))
            if final:
                return out
            done, i = done + n, i + 1

    def decode_lengths(self, ref_frames: tuple[int, ...] = ()) -> list[int]:
        """Distinct `context + new` lengths of the non-final chunks: the shapes worth a CUDA graph.

        `ref_frames`: reference lengths (Base ICL) whose first chunks' lengths to include as well.
        """
        lengths = set()
        for ref in (0, *ref_frames):
            done, i = 0, 0
            while True:  # until chunks are steady-sized and the context is full
                n = self.chunk_frames(i)
                ctx = min(self.ref_context if done == 0 else self.left_context_frames, done + ref)
                lengths.add(ctx + n)
                if i > len(self.ramp or ()) and n == self.steady_chunk_frames and ctx == self.left_context_frames:
                    break
                done, i = done + n, i + 1
        return sorted(lengths)

    def graph_lengths(self, stateful: bool, ref_frames: tuple[int, ...] = ()) -> list[int]:
        """The decode lengths worth a CUDA graph in Code2Wav: stateless, context + new frames of each chunk
        (`decode_lengths`); stateful, the new frames of each chunk size, plus the longest stateless length for
        chunks decoded fresh with their context."""
        stateless = self.decode_lengths(ref_frames)
        if not stateful:
            return stateless
        return sorted(set(self.chunk_sizes()) | {max(stateless)})

    def chunk_sizes(self) -> list[int]:
        """Distinct new-frame counts of the non-final chunks (first, ramp, steady): what a stateful decoder,
        which skips the context, decodes."""
        sizes, i = set(), 0
        while (n := self.chunk_frames(i)) not in sizes or i <= len(self.ramp or ()):
            sizes.add(n)
            i += 1
        return sorted(sizes)

    def context_overhead(self, total_frames: int, ref_frames: int = 0) -> float:
        """Decoded frames / new frames for a stream: the price of stateless decoding (1.0 = none)."""
        plan = self.plan(total_frames, ref_frames)
        new = sum(n for _, n in plan)
        return sum(c + n for c, n in plan) / new if new else 1.0


class StreamChunker:
    """Turns one stream's frames into CodecChunks following a ChunkSchedule. Not thread-safe (one per stream).

    `push(frames)` returns the chunks completed by those frames (often none); `flush(reason)` returns the
    final chunk (`final=True`) with the frames left over, possibly none: a stream always ends with exactly
    one final chunk, even one that produced 0 frames (that chunk has `codes` of shape [0, 16], context 0,
    and decodes to no samples). A second `flush` returns None. Every chunk's `codes` is
    `[context frames, new frames]`, int64.
    """

    def __init__(self, schedule: ChunkSchedule, request_id: str, ref_codes: np.ndarray | None = None):
        self.schedule, self.request_id = schedule, request_id
        keep = max(schedule.left_context_frames, schedule.ref_context)
        self._history = np.zeros((0, NUM_CODEBOOKS), dtype=np.int64)  # last `keep` frames before pending
        if ref_codes is not None:
            ref = _as_frames(ref_codes, "ref_codes")
            self._history = ref[max(0, len(ref) - keep):] if keep else ref[:0]
        self._keep = keep
        self._pending = np.zeros((0, NUM_CODEBOOKS), dtype=np.int64)
        self._seq = 0
        self._size_index = 0  # index into the schedule's sizes (== _seq unless `cut` restarted the ramp)
        self._emitted_frames = 0
        self._flushed = False

    @property
    def frames_to_next_chunk(self) -> int:
        """Frames still missing before `push` can return the next chunk (>= 1)."""
        return max(1, self.schedule.chunk_frames(self._size_index) - len(self._pending))

    def push(self, frames: np.ndarray) -> list[CodecChunk]:
        """Add frames ([n, 16] or one [16] frame); return the chunks they complete."""
        if self._flushed:
            raise RuntimeError(f"stream {self.request_id!r} was already flushed")
        frames = _as_frames(frames, "frames")
        self._pending = np.concatenate([self._pending, frames]) if len(self._pending) else frames
        out = []
        while len(self._pending) >= (n := self.schedule.chunk_frames(self._size_index)):
            out.append(self._emit(n, final=False, reason=None))
        return out

    def cut(self) -> CodecChunk | None:
        """Every pending frame now, as a non-final chunk (None: none pending), and the ramp starts over.

        For a stream that pauses (live text waiting for more text): the listener gets all audio so far, and
        after the pause, with its buffer empty, small chunks again.
        """
        if self._flushed:
            raise RuntimeError(f"stream {self.request_id!r} was already flushed")
        chunk = self._emit(len(self._pending), final=False, reason=None) if len(self._pending) else None
        self._size_index = 0
        return chunk

    def flush(self, finish_reason: FinishReason | None = None) -> CodecChunk | None:
        """The final chunk: every frame not yet emitted (maybe none), `final=True`. None once flushed."""
        if self._flushed:
            return None
        self._flushed = True
        return self._emit(len(self._pending), final=True, reason=finish_reason)

    def _emit(self, n: int, final: bool, reason: FinishReason | None) -> CodecChunk:
        new, self._pending = self._pending[:n], self._pending[n:]
        if n == 0:
            codes, ctx = np.zeros((0, NUM_CODEBOOKS), dtype=np.int64), 0
        else:
            limit = self.schedule.ref_context if self._emitted_frames == 0 else self.schedule.left_context_frames
            ctx = min(limit, len(self._history))
            codes = np.ascontiguousarray(np.concatenate([self._history[len(self._history) - ctx:], new]))
            if self._keep:
                self._history = np.concatenate([self._history, new])[-self._keep:]
        chunk = CodecChunk(self.request_id, self._seq, codes, ctx, final=final, finish_reason=reason)
        self._seq += 1
        self._size_index += 1
        self._emitted_frames += n
        return chunk


def receptive_field_frames(cfg: DecoderConfig) -> int:
    """Left context (frames) beyond which earlier codes cannot change a frame's samples (580 for the release).

    pre_conv (k3) + every attention layer's window - 1, plus the conv tail after the transformer: the
    ConvNeXt and vocoder convs' left pads, and one input sample per transposed conv with kernel > stride,
    each at its own sample rate. A chunk with at least this much context decodes exactly (up to float
    rounding: RoPE is relative, so restarting positions at 0 changes nothing else).
    """
    frames = 2 + cfg.num_hidden_layers * (cfg.sliding_window - 1)
    rate = 1
    for r in cfg.upsampling_ratios:  # ConvTranspose(k=r, s=r): no lookback; ConvNeXt dwconv k7
        rate *= r
        frames += 6 / rate
    frames += 6 / rate  # decoder[0]: conv k7
    for r in cfg.upsample_rates:  # ConvTranspose(k=2r, s=r): 1 input sample back; residual units k7, dil 1/3/9
        frames += 1 / rate
        rate *= r
        frames += 6 * (1 + 3 + 9) / rate
    frames += 6 / rate  # final conv k7
    return math.ceil(frames)


def _as_frames(frames: np.ndarray, what: str) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim == 1:
        frames = frames[None]
    if frames.ndim != 2 or frames.shape[1] != NUM_CODEBOOKS or not np.issubdtype(frames.dtype, np.integer):
        raise ValueError(f"{what} must be integer codes [n, {NUM_CODEBOOKS}], got {frames.dtype} {frames.shape}")
    if frames.size and (frames.min() < 0 or frames.max() >= CODEBOOK_SIZE):
        raise ValueError(f"{what} holds codes outside [0, {CODEBOOK_SIZE})")
    return frames.astype(np.int64, copy=False)
