"""Code2WavEngine: batched decoding of CodecChunks from many streams (buckets, CUDA graphs), stateless or
stateful.

`decode(chunks)` returns the float32 samples of each chunk's new frames only. Stateless (the default), it
decodes each chunk's `codes` (left context + new frames). Stateful (`stateful=True`), it keeps each stream's
decoder state on the device between its chunks (stages/code2wav/stateful.py) and decodes only the new
frames of a chunk that continues its stream; a chunk whose stream state it lacks (first chunk, another
replica had the stream, evicted) is decoded from zero state over its context, i.e. statelessly
(stages/code2wav/stream_slots.py). Chunks of any lengths batch together: they are sorted by length and
split into forwards by a small cost model (padded work + a fixed cost per forward); each forward right-pads
its chunks with code 0 to a length bucket and its batch to a batch bucket, which is exact because every
decoder layer is causal (and the stateful decoder saves each row's state at its own length). On CUDA,
`warmup()` captures one graph per (batch bucket, length bucket); other shapes run eagerly. The decoder's
dtype is the serving dtype (bf16), fp32 for parity.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from stages import invariant_conv
from stages.code2wav import compiled, fast
from stages.code2wav.engine_config import Code2WavEngineConfig
from stages.code2wav.model import Code2WavDecoder
from stages.code2wav.stateful import DecoderStates, StatefulDecoder, check_layout
from stages.code2wav.stream_slots import SlotRow, StreamSlots
from stages.compile_cache import CompileCache
from stages.contract import CODEBOOK_SIZE, CodecChunk
from stages.cuda_graph import capture_graph

# The grad mode of every decode: no_grad, not inference_mode. Why: Dynamo's cached work (stages/compile_cache.py)
# of a function compiled under inference_mode is loaded but not reused by the next process (torch 2.13, CPU: every
# variant traced again, 16 s of a small decoder's start), while under no_grad it is (nothing traced, as the Talker,
# which runs under no_grad). tests/stages/test_compile_cache.py checks this mode round-trips.
DECODE_MODE = torch.no_grad


@dataclass(frozen=True)
class Code2WavStats:
    batches: int  # decode() calls
    chunks: int
    forwards: int
    graph_forwards: int
    new_frames: int  # frames whose samples were returned
    decoded_frames: int  # frames decoded: context + new, or new only for chunks continued from their state
    padded_frames: int  # batch x length of the forwards (padding included): the work done
    busy_s: float  # wall time inside decode()
    queued: int  # decode() calls waiting for the engine right now
    graphs: int
    continued: int = 0  # stateful: chunks decoded from their stream's state (new frames only)
    fresh: int = 0  # stateful: chunks decoded from zero state over their context (first chunks, misses)
    evicted: int = 0  # stateful: streams whose state gave its slot to another stream


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    codes: torch.Tensor  # [B, 16, T] static input
    rows: torch.Tensor | None  # stateful: [3, B] static input (slots, fresh, lengths); else None
    wav: torch.Tensor  # [B, 1, T * 1920] static output (valid until the next replay of any graph)


_STATELESS = SlotRow(0, True, 0)  # every chunk decoded over its context, in one wave


class Code2WavEngine:
    """Thread-safe: a lock serializes `decode`/`warmup`; call them from one thread (graphs replay on it).

    The engine owns the decoder: with `fast_kernels` on a CUDA device it switches the instance to the
    fused kernels of `stages.code2wav.fast` (off: back to the eager modules).
    """

    config_cls: ClassVar[type] = Code2WavEngineConfig  # what `engine_kwargs` configure (deployments/loading.py)

    def __init__(self, decoder: Code2WavDecoder, config: Code2WavEngineConfig | None = None):
        config = config or Code2WavEngineConfig()
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
        if config.compile:
            self.compiled = compiled.enable(decoder)
        else:
            compiled.disable(decoder)
            self.compiled = False
        # torch.compile specializes sizes of 1: a batch of one chunk, or chunks of one frame, would each be a trace
        # and an Inductor compile of its own (four per compiled function where two sizes vary, each also loaded from
        # the compile cache on every start). A compiled engine pads both to 2 instead: one trace serves every shape.
        self.min_size = 2 if self.compiled else 1
        self.batch_buckets = self._buckets([*(b for b in config.batch_buckets if b < config.max_batch_size),
                                            config.max_batch_size])
        self.length_buckets = self._buckets(config.length_buckets)
        self.stateful = config.stateful
        if config.stateful:
            check_layout(decoder)
            self._states = DecoderStates(decoder, config.state_slots)
            self._stateful_decoder = StatefulDecoder(
                decoder, self._states, compiled.stateful_transformer() if self.compiled else None)
            self._slots = StreamSlots(config.state_slots)
        self.deterministic = config.deterministic
        if self.deterministic:  # convolution algorithms chosen by shape alone, never by timing (the process's flags)
            torch.backends.cudnn.benchmark = False
            torch.backends.cudnn.deterministic = True
        # deterministic: the decode's convolutions as products (stages/invariant_conv.py), rerouted while the engine
        # decodes or captures (a captured graph keeps them); cuDNN computes a row by its place in the batch
        self.invariant_convs = self.deterministic and invariant_conv.covers(self.device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._lock = threading.Lock()
        self._waiting = 0
        self._counts = dict(batches=0, chunks=0, forwards=0, graph_forwards=0, new_frames=0, decoded_frames=0,
                            padded_frames=0)
        self._busy = 0.0

    # ------------------------------------------------------------------ lifecycle
    def warmup(self, log: Callable[[str], None] = print) -> float:
        """Capture the CUDA graphs (CUDA + `cuda_graphs`), else run one small eager decode. Returns seconds."""
        with self._lock, self._convolutions():
            t0 = time.perf_counter()
            cache = self.compile_cache()
            if cache is not None:
                cache.load(log)
            if self.device.type == "cuda" and self.config.cuda_graphs:
                self._capture(log)
            else:
                with DECODE_MODE():
                    self._run(torch.zeros(1, self.num_codebooks, 2, dtype=torch.long, device=self.device),
                              self._row_inputs(1, 2))
                log(f"[code2wav] eager warm-up on {self.device} ({self.dtype}, fast kernels {self.fast_kernels}) "
                    f"in {time.perf_counter() - t0:.2f} s")
            if cache is not None:
                cache.save(log)
            return time.perf_counter() - t0

    def _convolutions(self) -> contextlib.AbstractContextManager:
        return invariant_conv.invariant_conv() if self.invariant_convs else contextlib.nullcontext()

    def compile_cache(self) -> CompileCache | None:
        """The compile cache file of this decoder's compiled code, which `warmup` loads before the first compile
        (None: the engine does not compile, or keeps no cache)."""
        if not (self.compiled and self.config.compile_cache_dir):
            return None
        # the shapes its functions see: the Talker's first-chunk decoder (a few small graphs) and Code2Wav's engine
        # load the same model and must keep their work apart (stages/compile_cache.py)
        shapes = {"code2wav": repr(self.decoder.cfg), "dtype": str(self.dtype), "graphs": self.graph_shapes(),
                  "stateful": self.config.stateful}
        return CompileCache.for_model(self.config.compile_cache_dir, self.device, shapes,
                                      sources=compiled.COMPILED_SOURCES)

    def graph_shapes(self) -> list[tuple[int, int]]:
        """(batch, length) pairs that get a graph: every bucket pair within `max_frames_per_forward`; deterministic:
        each length bucket at its one batch size."""
        if self.deterministic:
            return [(self.config.fixed_batch(t, self.min_size), t) for t in self.length_buckets]
        return [(b, t) for b in self.batch_buckets for t in self.length_buckets
                if b * t <= self.config.max_frames_per_forward]

    @DECODE_MODE()
    def _capture(self, log: Callable[[str], None]) -> None:
        t0 = time.perf_counter()
        shapes = sorted(self.graph_shapes(), key=lambda s: (s[0] * s[1], s), reverse=True)  # largest first
        log(f"[code2wav] {self.dtype}, fast kernels {self.fast_kernels}, compiled {self.compiled}; capturing "
            f"{len(shapes)} CUDA graphs: "
            f"batch {self.batch_buckets} x length "
            f"{self.length_buckets} frames (<= {self.config.max_frames_per_forward} frames per forward)")
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        gen = torch.Generator(device=self.device).manual_seed(0)
        for i, (b, t) in enumerate(shapes):
            codes = torch.randint(0, CODEBOOK_SIZE, (b, self.num_codebooks, t), generator=gen, device=self.device)
            rows = self._row_inputs(b, t)
            # free_cached: the warm-up's activations must not sit beside the graph pool
            graph, wav = capture_graph(lambda codes=codes, rows=rows: self._run(codes, rows), pool, side,
                                       free_cached=True)
            self._graphs[(b, t)] = _Graph(graph, codes, rows, wav)
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
        with self._lock, self._convolutions():
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

    @DECODE_MODE()
    def _decode(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        spf = self.samples_per_frame
        out: list[np.ndarray | None] = [None] * len(chunks)
        if self.stateful:
            rows = self._slots.assign(chunks)
        else:
            rows = [_STATELESS if c.num_new > 0 else None for c in chunks]
        for i, row in enumerate(rows):
            if row is None:
                out[i] = np.zeros(0, dtype=np.float32)
        try:
            for wave in range(1 + max((r.wave for r in rows if r is not None), default=-1)):
                todo = [i for i, r in enumerate(rows) if r is not None and r.wave == wave]
                pieces, order = [], []
                lengths = [chunks[i].codes.shape[0] - rows[i].start(chunks[i]) for i in todo]
                for idx, b_pad, t_pad in self._plan(lengths):
                    group = [todo[k] for k in idx]
                    pieces.append(self._forward([(chunks[i], rows[i]) for i in group], b_pad, t_pad))
                    order.extend(group)
                if pieces:
                    flat = (torch.cat(pieces) if len(pieces) > 1 else pieces[0]).cpu().numpy()
                    offset = 0
                    for i in order:
                        n = chunks[i].num_new * spf
                        out[i] = flat[offset:offset + n]
                        offset += n
        except BaseException:
            if self.stateful:  # states may be half-written: these streams start over (fresh) next time
                for c in chunks:
                    self._slots.forget(c.request_id)
            raise
        if self.stateful:
            self._slots.release(chunks)
        c = self._counts
        c["batches"] += 1
        c["chunks"] += len(chunks)
        decoded = [(ch, r) for ch, r in zip(chunks, rows, strict=True) if r is not None]
        c["new_frames"] += sum(ch.num_new for ch, _ in decoded)
        c["decoded_frames"] += sum(ch.codes.shape[0] - r.start(ch) for ch, r in decoded)
        return out  # type: ignore[return-value]

    def _forward(self, items: list[tuple[CodecChunk, SlotRow]], b_pad: int, t_pad: int) -> torch.Tensor:
        """One forward of these chunks, padded to [b_pad, t_pad]: the new frames' samples, [sum new * spf] f32."""
        spf = self.samples_per_frame
        codes = np.zeros((b_pad, self.num_codebooks, t_pad), dtype=np.int64)
        for r, (c, row) in enumerate(items):
            part = c.codes[row.start(c):]
            codes[r, :, :part.shape[0]] = part.T
        rows = None
        if self.stateful:  # slot, fresh, valid frames of each row, in one array: one host-to-device copy
            rows = np.zeros((3, b_pad), dtype=np.int64)
            rows[0], rows[1] = self._slots.scratch, 1  # padding rows: fresh, on the scratch slot
            for r, (c, row) in enumerate(items):
                rows[:, r] = row.slot, row.fresh, c.codes.shape[0] - row.start(c)
            rows = torch.from_numpy(rows)
        graph = self._graphs.get((b_pad, t_pad))
        if graph is not None:
            graph.codes.copy_(torch.from_numpy(codes))
            if rows is not None:
                graph.rows.copy_(rows)
            graph.graph.replay()
            wav = graph.wav
            self._counts["graph_forwards"] += 1
        else:
            wav = self._run(torch.from_numpy(codes).to(self.device), None if rows is None else rows.to(self.device))
        self._counts["forwards"] += 1
        self._counts["padded_frames"] += b_pad * t_pad
        # copy out now: a graph's output buffer is overwritten by the next replay
        return torch.cat([wav[r, 0, row.offset(c) * spf:(row.offset(c) + c.num_new) * spf]
                          for r, (c, row) in enumerate(items)]).float()

    def _run(self, codes: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The decoder on device tensors: stateless, or stateful over rows [3, B] = (slots, fresh, lengths)."""
        if rows is None:
            return self.decoder(codes)
        return self._stateful_decoder(codes, rows[0], rows[1].bool(), rows[2])

    def _row_inputs(self, batch: int, length: int) -> torch.Tensor | None:
        """Stateful row inputs for warm-up and capture: every row fresh, on the scratch slot."""
        if not self.stateful:
            return None
        return torch.tensor([[self._slots.scratch], [1], [length]], device=self.device).expand(3, batch).contiguous()

    # ------------------------------------------------------------------ batching plan
    def _plan(self, lengths: list[int]) -> list[tuple[list[int], int, int]]:
        """Split chunks (by index into `lengths`) into forwards: [(indices, padded batch, padded length)].

        Sorted by length, each forward takes a contiguous run; dynamic programming minimises
        sum(padded batch * padded length + forward_overhead_frames).
        """
        n = len(lengths)
        if n == 0:
            return []
        if self.deterministic:
            return self._fixed_plan(lengths)
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

    def _fixed_plan(self, lengths: list[int]) -> list[tuple[list[int], int, int]]:
        """Deterministic mode: a chunk's forward shape depends on its own length alone (kernels and their rounding
        follow the shape): chunks of one padded length together, `fixed_batch` of them a forward, padded to it."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(lengths):
            groups.setdefault(self._length_pad(n), []).append(i)
        plan = []
        for t_pad, idx in sorted(groups.items()):
            b_pad = self.config.fixed_batch(t_pad, self.min_size)
            plan += [(idx[k:k + b_pad], b_pad, t_pad) for k in range(0, len(idx), b_pad)]
        return plan

    def _buckets(self, sizes) -> tuple[int, ...]:
        """`sizes` raised to `min_size`, sorted, each once."""
        return tuple(sorted({max(n, self.min_size) for n in sizes}))

    def _length_pad(self, length: int) -> int:
        length = max(length, self.min_size)
        if not self._graphs and not self.deterministic:
            return length  # eager: no reason to pad further (deterministic: the buckets fix the shapes)
        k = bisect.bisect_left(self.length_buckets, length)
        return self.length_buckets[k] if k < len(self.length_buckets) else length

    def _batch_pad(self, count: int, t_pad: int) -> int:
        count = max(count, self.min_size)
        k = bisect.bisect_left(self.batch_buckets, count)
        if k < len(self.batch_buckets) and (self.batch_buckets[k], t_pad) in self._graphs:
            return self.batch_buckets[k]
        return count

    # ------------------------------------------------------------------ stats
    def stats(self) -> Code2WavStats:
        slots = self._slots.counts if self.stateful else {}
        return Code2WavStats(**self._counts, busy_s=self._busy, queued=self._waiting, graphs=len(self._graphs),
                             continued=slots.get("continued", 0), fresh=slots.get("fresh", 0),
                             evicted=slots.get("evicted", 0))
