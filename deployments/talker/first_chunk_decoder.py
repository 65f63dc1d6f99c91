"""FirstChunkDecoder: the Talker replica decodes a stream's first chunk itself while its engine is lightly loaded.

Why: a served first chunk otherwise makes two more hops (ingress -> Code2Wav -> ingress) and is decoded in the
Code2Wav process, which time-slices the GPU with the Talker's: a one-frame decode there takes about twice as long as
in one process, plus the hops (docs/benchmarks.md "First audio hop by hop"). Here it is decoded in the Talker's own
CUDA context, on a high-priority stream of its own beside the engine's steps (as `bench.pipeline` runs the two
engines), and travels back with the codec chunk (`CodecChunk.pcm`); the ingress, or Code2Wav for an unread ObjectRef,
takes that PCM instead of decoding.

Exact: the decoder is causal and a stream's first chunk starts from zero state, so this is the samples the
whole decode gives for those frames.

Its chunk 1 too: once the first chunk's 80 ms play, chunk 1 must be there, and through Code2Wav's queue it could come
late (an earlier first audio with an unchanged second chunk gaps: docs/benchmarks.md). Chunk 1's left context is the
whole stream before it (the first chunk's frames), so its decode from zero state is exact as well; Code2Wav decodes
from chunk 2 on, over its left context (its `fresh` path).

Only while the engine runs at most `max_running` requests when the first chunk is cut: under load the decode
would take GPU time from every running stream's step, and Code2Wav batches them with everything else more
cheaply. With `count_pending` the decodes pending here (asked, not yet answered) count as running requests too:
streams that arrive one by one are decoded here at a load where a burst of arrivals (a hundred first chunks cut by
one step) leaves all but the first few to Code2Wav's larger batches.

Built beside the serving engine, not before the replica is ready: its graphs (and their compiles: the longest part
of a cold start after the engine's own, docs/benchmarks.md "Where a cold start's time goes") are a shortcut, not a
part of the serving path. Until `build` has finished, `takes` says no and Code2Wav decodes every chunk.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from deployments.audio.formats import float_to_pcm16
from deployments.coalescing import Coalescer
from stages.chunking import ChunkSchedule
from stages.contract import CodecChunk

if TYPE_CHECKING:
    from stages.code2wav.engine import Code2WavEngineConfig

MAX_BATCH = 8  # default: chunks decoded together (those waiting while a decode runs)


def engine_config(schedule: ChunkSchedule, max_batch: int = MAX_BATCH, compile: bool = False,
                  compile_cache_dir: str | None = None) -> tuple[Code2WavEngineConfig, int, int]:
    """The first-chunk decoder's engine for `schedule`: graphs for batches 1, 2, 4, ... up to `max_batch` of the
    configured first chunk without context (a Base ICL first chunk has reference frames as context: it goes to
    Code2Wav) and of chunk 1 over it. -> (config, the first chunk's frames, chunk 1's decode length)."""
    from stages.code2wav.engine import Code2WavEngineConfig  # torch: in the Talker replica only (tests/test_layering.py)

    (_, first), (context1, new1) = schedule.plan(schedule.chunk_frames(0) + schedule.chunk_frames(1) + 1)[:2]
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch) + (max_batch,)
    config = Code2WavEngineConfig(max_batch_size=max_batch, stateful=False, batch_buckets=buckets,
                                  length_buckets=tuple(sorted({first, context1 + new1})), compile=compile,
                                  compile_cache_dir=compile_cache_dir)
    return config, first, context1 + new1


class FirstChunkDecoder:
    def __init__(self, decoder_model: Any, schedule: ChunkSchedule, max_running: int, log=print,
                 count_pending: bool = False, max_batch: int = MAX_BATCH,
                 compile: bool = False, compile_cache_dir: str | None = None):
        """`decoder_model`: the checkpoint's codec decoder (`Qwen3TTS.decoder`), on the Talker's device; `schedule`:
        the deployment's, whose first two chunks (without reference context) get graphs; `count_pending`: the gate
        counts the decodes pending here as running requests; `max_batch`: chunks in one forward (graphs for batches 1,
        2, 4, ... up to it); `compile`: the decoder's dequantizer and pre-transformer through torch.compile (CUDA;
        fewer kernels per forward: stages/code2wav/compiled.py), its work kept in `compile_cache_dir`."""
        from stages.code2wav.engine import Code2WavEngine

        self.max_running, self.count_pending = max_running, count_pending
        self.pending = 0  # decodes asked and not yet answered
        config, self.max_frames, self.max_length1 = engine_config(schedule, max_batch, compile, compile_cache_dir)
        self.max_batch = max_batch
        self._engine = Code2WavEngine(decoder_model, config)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="first-chunk-decoder")
        self._stream = None
        # decodes waiting together share one forward (padded to the longest: the decoder is causal, so padding
        # after a chunk never changes its samples)
        self._batches: Coalescer[CodecChunk, np.ndarray] = Coalescer(self._decode_batch, max_batch=max_batch)
        self._log = log
        self.decoded = 0  # chunks decoded here
        self.ready = False  # `build` finished: chunks are taken

    async def build(self, then: Callable[[], None] | None = None) -> None:
        """Build off the event loop while the replica serves; a build that fails leaves every chunk to Code2Wav.
        `then`: run in the build's thread once the graphs are built, before the decoder says it is ready (after a
        failed build too)."""
        self._log("[talker] first-chunk decoder building beside the serving engine (Code2Wav decodes every chunk "
                  "until it is ready)")
        try:
            await asyncio.to_thread(self._start, then)
        except Exception as e:  # a shortcut that failed to build must not take the replica down
            if then is not None:  # what the build left behind before it failed
                await asyncio.to_thread(then)
            self._log(f"[talker] first-chunk decoder not built ({e!r}): Code2Wav decodes every first chunk")
            return
        self.ready = True

    def _start(self, then: Callable[[], None] | None) -> None:
        """Graphs for the first-chunk shapes and the stream the decodes run on (blocking), then `then`."""
        import torch

        if self._engine.device.type == "cuda":
            # high priority: the decode's kernels go before the engine's queued step kernels
            self._stream = torch.cuda.Stream(self._engine.device, priority=-1)
        t0 = time.perf_counter()
        self._engine.warmup(self._log)
        if then is not None:
            then()
        self._log(f"[talker] first-chunk decoder ready in {time.perf_counter() - t0:.1f} s (first chunks of "
                  f"<= {self.max_frames} frames and their chunk 1, while <= {self.max_running} requests run)")

    def takes(self, chunk: CodecChunk, running: int, first: CodecChunk | None) -> bool:
        """Whether `chunk` is decoded here (once built): a stream's first chunk (no context, at most the configured frames)
        while at most `max_running` requests run (with `count_pending`, requests and pending decodes); its chunk 1
        when the first was (`first`: the stream's first chunk as it left, with `pcm` if decoded here) and its
        context is every frame before it (whatever is pending: the first chunk's audio must be followed)."""
        if not self.ready:
            return False
        if chunk.seq == 0:
            load = running + (self.pending if self.count_pending else 0)
            return chunk.context == 0 and 0 < chunk.num_new <= self.max_frames and load <= self.max_running
        return (chunk.seq == 1 and first is not None and first.pcm is not None and chunk.context == first.num_new
                and chunk.codes.shape[0] <= self.max_length1)

    async def decode(self, chunk: CodecChunk) -> np.ndarray:
        """int16 PCM of the chunk's new frames (a cancelled stream does not cancel the others' decode)."""
        self.pending += 1  # until answered, or until this stream is cancelled (its decode then runs on, uncounted)
        try:
            return await self._batches.submit(chunk)
        finally:
            self.pending -= 1

    async def _decode_batch(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        waves = await asyncio.get_running_loop().run_in_executor(self._executor, self._decode, chunks)
        self.decoded += len(chunks)
        return [float_to_pcm16(wave) for wave in waves]

    def _decode(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        if self._stream is None:
            return self._engine.decode(chunks)
        import torch

        with torch.cuda.stream(self._stream):
            return self._engine.decode(chunks)

    def stats(self):
        """Its engine's counters (`stages.code2wav.engine.Code2WavStats`)."""
        return self._engine.stats()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)
