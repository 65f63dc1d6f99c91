"""Code2WavEngine: stateless, batched decoding of CodecChunks from many streams (buckets, CUDA graphs).

`decode(chunks)` decodes each chunk's `codes` (left context + new frames) and returns the float32 samples
of its new frames only. Chunks of any lengths batch together: they are sorted by length and split into
forwards by a small cost model (padded work + a fixed cost per forward); each forward right-pads its
chunks with code 0 to a length bucket and its batch to a batch bucket, which is exact because every
decoder layer is causal. On CUDA, `warmup()` captures one graph per (batch bucket, length bucket); other
shapes run eagerly. The decoder's dtype is the serving dtype (bf16), fp32 for parity.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import torch

from stages.chunking import ChunkSchedule
from stages.code2wav import fast
from stages.code2wav.model import Code2WavDecoder
from stages.contract import CODEBOOK_SIZE, CodecChunk

DEFAULT_LENGTH_BUCKETS = tuple(ChunkSchedule().decode_lengths())  # (2, 6, 14, 30, 50)


@dataclass(frozen=True)
class Code2WavEngineConfig:
    """Shapes and limits of the engine. Sizes are in frames (80 ms, 1920 samples each).

    `length_buckets` are the decode lengths (context + new) with CUDA graphs, normally those of the chunk
    schedule (`for_schedule`); longer chunks run eagerly at their own length. Graphs exist for every
    batch bucket (capped at `max_batch_size`) x length bucket whose `batch * length` fits in
    `max_frames_per_forward`, which also bounds the activation memory of one forward (about 0.8 MB per
    frame in bf16 with the fused kernels, 2.3 MB without; docs/code2wav.md).
    """

    max_batch_size: int = 64  # chunks in one forward at most
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    length_buckets: tuple[int, ...] = DEFAULT_LENGTH_BUCKETS
    cuda_graphs: bool = True
    fast_kernels: bool = True  # fused Triton SnakeBeta etc. on CUDA (stages/code2wav/fast.py); False: eager modules
    max_frames_per_forward: int = 4096  # padded batch x padded length of one forward
    forward_overhead_frames: int = 64  # cost of one forward in frames of work (batching plan; ~2 ms on H100)

    def __post_init__(self) -> None:
        for f in fields(self):  # lists from YAML/JSON
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        if self.max_batch_size < 1 or self.max_frames_per_forward < 1 or self.forward_overhead_frames < 0:
            raise ValueError("max_batch_size and max_frames_per_forward must be >= 1, forward_overhead_frames >= 0")
        if not self.batch_buckets or min(self.batch_buckets) < 1:
            raise ValueError("batch_buckets must be non-empty and >= 1")
        if self.length_buckets and min(self.length_buckets) < 1:
            raise ValueError("length_buckets must be >= 1")

    @classmethod
    def for_schedule(cls, schedule: ChunkSchedule, ref_frames: tuple[int, ...] = (), **kwargs) -> Code2WavEngineConfig:
        """Length buckets = the schedule's chunk lengths (and first-chunk lengths for these reference lengths)."""
        return cls(length_buckets=tuple(schedule.decode_lengths(ref_frames)), **kwargs)


@dataclass(frozen=True)
class Code2WavStats:
    batches: int  # decode() calls
    chunks: int
    forwards: int
    graph_forwards: int
    new_frames: int  # frames whose samples were returned
    decoded_frames: int  # context + new frames of the chunks (what a stateful decoder would not redo)
    padded_frames: int  # batch x length of the forwards (padding included): the work done
    busy_s: float  # wall time inside decode()
    queued: int  # decode() calls waiting for the engine right now
    graphs: int


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    codes: torch.Tensor  # [B, 16, T] static input
    wav: torch.Tensor  # [B, 1, T * 1920] static output (valid until the next replay of any graph)


class Code2WavEngine:
    """Thread-safe: a lock serializes `decode`/`warmup`; call them from one thread (graphs replay on it).

    The engine owns the decoder: with `fast_kernels` on a CUDA device it switches the instance to the
    fused kernels of `stages.code2wav.fast` (off: back to the eager modules).
    """

    config_cls: ClassVar[type] = Code2WavEngineConfig  # what `engine_kwargs` configure (deployments/loading.py)

    def __init__(self, decoder: Code2WavDecoder, config: Code2WavEngineConfig = Code2WavEngineConfig()):
        self.decoder, self.config = decoder.eval(), config
        p = next(decoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.samples_per_frame = decoder.samples_per_frame
        self.num_codebooks = decoder.cfg.num_quantizers
        if config.fast_kernels:
            self.fast_kernels = fast.enable_fast_kernels(decoder)
        else:
            fast.disable_fast_kernels(decoder)
            self.fast_kernels = False
        self.batch_buckets = tuple(sorted({b for b in config.batch_buckets if b < config.max_batch_size}
                                          | {config.max_batch_size}))
        self.length_buckets = tuple(sorted(set(config.length_buckets)))
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._lock = threading.Lock()
        self._waiting = 0
        self._counts = dict(batches=0, chunks=0, forwards=0, graph_forwards=0, new_frames=0, decoded_frames=0,
                            padded_frames=0)
        self._busy = 0.0

    # ------------------------------------------------------------------ lifecycle
    def warmup(self, log: Callable[[str], None] = print) -> float:
        """Capture the CUDA graphs (CUDA + `cuda_graphs`), else run one small eager decode. Returns seconds."""
        with self._lock:
            t0 = time.perf_counter()
            if self.device.type == "cuda" and self.config.cuda_graphs:
                self._capture(log)
            else:
                with torch.inference_mode():
                    self.decoder(torch.zeros(1, self.num_codebooks, 2, dtype=torch.long, device=self.device))
                log(f"[code2wav] eager warm-up on {self.device} ({self.dtype}, fast kernels {self.fast_kernels}) "
                    f"in {time.perf_counter() - t0:.2f} s")
            return time.perf_counter() - t0

    def graph_shapes(self) -> list[tuple[int, int]]:
        """(batch, length) pairs that get a graph: every bucket pair within `max_frames_per_forward`."""
        return [(b, t) for b in self.batch_buckets for t in self.length_buckets
                if b * t <= self.config.max_frames_per_forward]

    @torch.inference_mode()
    def _capture(self, log: Callable[[str], None]) -> None:
        t0 = time.perf_counter()
        shapes = sorted(self.graph_shapes(), key=lambda s: (s[0] * s[1], s), reverse=True)  # largest first
        log(f"[code2wav] {self.dtype}, fast kernels {self.fast_kernels}; capturing {len(shapes)} CUDA graphs: "
            f"batch {self.batch_buckets} x length "
            f"{self.length_buckets} frames (<= {self.config.max_frames_per_forward} frames per forward)")
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        gen = torch.Generator(device=self.device).manual_seed(0)
        for i, (b, t) in enumerate(shapes):
            codes = torch.randint(0, CODEBOOK_SIZE, (b, self.num_codebooks, t), generator=gen, device=self.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                for _ in range(2):  # kernels, cuDNN plans, allocator, outside the capture
                    self.decoder(codes)
            current.wait_stream(side)
            torch.cuda.empty_cache()  # the warm-up's activations must not sit beside the graph pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                wav = self.decoder(codes)
            self._graphs[(b, t)] = _Graph(graph, codes, wav)
            if (i + 1) % max(1, len(shapes) // 8) == 0 or i + 1 == len(shapes):
                log(f"[code2wav] captured {i + 1}/{len(shapes)} graphs ({time.perf_counter() - t0:.1f} s)")
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager warm-up runs' cached blocks; graph memory stays in its pool
        log(f"[code2wav] {len(shapes)} graphs captured in {time.perf_counter() - t0:.1f} s; "
            f"{torch.cuda.memory_reserved(self.device) / 2**30:.2f} GiB reserved on {self.device}")

    # ------------------------------------------------------------------ decode
    def decode(self, chunks: list[CodecChunk], checked: bool = False) -> list[np.ndarray]:
        """Float32 PCM of each chunk's new frames (`num_new * 1920` samples), in the order given.

        `checked=True`: the caller already ran `check_chunk` on each (the deployment does, to fail a malformed
        chunk alone), so each chunk is validated once.
        """
        if not checked:
            for i, c in enumerate(chunks):
                self.check_chunk(c, i)
        self._waiting += 1
        with self._lock:
            self._waiting -= 1
            t0 = time.perf_counter()
            try:
                return self._decode(chunks)
            finally:
                self._busy += time.perf_counter() - t0

    def check_chunk(self, chunk: CodecChunk, index: int = 0) -> None:
        """Raise ValueError for a chunk the decoder cannot take (wrong shape, context, or code range).

        Out-of-range codes would be a device-side assert on CUDA, which poisons the whole process.
        """
        codes = chunk.codes
        if (not isinstance(codes, np.ndarray) or codes.ndim != 2 or codes.shape[1] != self.num_codebooks
                or not np.issubdtype(codes.dtype, np.integer)):
            raise ValueError(f"chunk {index} ({chunk.request_id!r} #{chunk.seq}): codes must be integer "
                             f"[frames, {self.num_codebooks}], got {getattr(codes, 'dtype', type(codes))} "
                             f"{getattr(codes, 'shape', '')}")
        if not 0 <= chunk.context <= codes.shape[0]:
            raise ValueError(f"chunk {index} ({chunk.request_id!r} #{chunk.seq}): context {chunk.context} "
                             f"outside [0, {codes.shape[0]}]")
        if codes.size and (codes.min() < 0 or codes.max() >= CODEBOOK_SIZE):
            raise ValueError(f"chunk {index} ({chunk.request_id!r} #{chunk.seq}): codes outside [0, {CODEBOOK_SIZE})")

    @torch.inference_mode()
    def _decode(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        spf = self.samples_per_frame
        out: list[np.ndarray | None] = [None] * len(chunks)
        todo = [i for i, c in enumerate(chunks) if c.num_new > 0]
        for i, c in enumerate(chunks):
            if c.num_new <= 0:
                out[i] = np.zeros(0, dtype=np.float32)
        pieces, order = [], []
        for idx, b_pad, t_pad in self._plan([chunks[i].codes.shape[0] for i in todo]):
            group = [todo[k] for k in idx]
            pieces.append(self._forward([chunks[i] for i in group], b_pad, t_pad))
            order.extend(group)
        if pieces:
            flat = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).cpu().numpy()
            offset = 0
            for i in order:
                n = chunks[i].num_new * spf
                out[i] = flat[offset:offset + n]
                offset += n
        c = self._counts
        c["batches"] += 1
        c["chunks"] += len(chunks)
        c["new_frames"] += sum(chunks[i].num_new for i in todo)
        c["decoded_frames"] += sum(chunks[i].codes.shape[0] for i in todo)
        return out  # type: ignore[return-value]

    def _forward(self, chunks: list[CodecChunk], b_pad: int, t_pad: int) -> torch.Tensor:  # -> [sum new * spf] f32
        spf = self.samples_per_frame
        codes = np.zeros((b_pad, self.num_codebooks, t_pad), dtype=np.int64)
        for r, c in enumerate(chunks):
            codes[r, :, :c.codes.shape[0]] = c.codes.T
        graph = self._graphs.get((b_pad, t_pad))
        if graph is not None:
            graph.codes.copy_(torch.from_numpy(codes))
            graph.graph.replay()
            wav = graph.wav
            self._counts["graph_forwards"] += 1
        else:
            wav = self.decoder(torch.from_numpy(codes).to(self.device))
        self._counts["forwards"] += 1
        self._counts["padded_frames"] += b_pad * t_pad
        # copy out now: a graph's output buffer is overwritten by the next replay
        return torch.cat([wav[r, 0, c.context * spf:c.codes.shape[0] * spf] for r, c in enumerate(chunks)]).float()

    # ------------------------------------------------------------------ batching plan
    def _plan(self, lengths: list[int]) -> list[tuple[list[int], int, int]]:
        """Split chunks (by index into `lengths`) into forwards: [(indices, padded batch, padded length)].

        Sorted by length, each forward takes a contiguous run; dynamic programming minimises
        sum(padded batch * padded length + forward_overhead_frames).
        """
        n = len(lengths)
        if n == 0:
            return []
        order = sorted(range(n), key=lengths.__getitem__)
        cfg = self.config
        best = [0.0] + [float("inf")] * n
        choice: list[tuple[int, int, int]] = [(0, 0, 0)] * (n + 1)
        for j in range(1, n + 1):
            t_pad = self._length_pad(lengths[order[j - 1]])
            counts = {*self.batch_buckets, max(1, min(cfg.max_batch_size, cfg.max_frames_per_forward // t_pad))}
            for count in counts:
                i = max(0, j - count)
                b_pad = self._batch_pad(j - i, t_pad)
                if (b_pad * t_pad > cfg.max_frames_per_forward and j - i > 1) or j - i > cfg.max_batch_size:
                    continue
                cost = best[i] + cfg.forward_overhead_frames + b_pad * t_pad
                if cost < best[j]:
                    best[j], choice[j] = cost, (i, b_pad, t_pad)
        plan = []
        j = n
        while j > 0:
            i, b_pad, t_pad = choice[j]
            plan.append(([order[k] for k in range(i, j)], b_pad, t_pad))
            j = i
        return plan[::-1]

    def _length_pad(self, length: int) -> int:
        if not self._graphs:
            return length  # eager: no reason to pad
        k = bisect.bisect_left(self.length_buckets, length)
        return self.length_buckets[k] if k < len(self.length_buckets) else length

    def _batch_pad(self, count: int, t_pad: int) -> int:
        k = bisect.bisect_left(self.batch_buckets, count)
        if k < len(self.batch_buckets) and (self.batch_buckets[k], t_pad) in self._graphs:
            return self.batch_buckets[k]
        return count

    # ------------------------------------------------------------------ stats
    def stats(self) -> Code2WavStats:
        return Code2WavStats(**self._counts, busy_s=self._busy, queued=self._waiting, graphs=len(self._graphs))
