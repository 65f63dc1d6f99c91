"""FirstChunkDecoder: the Talker replica decodes a stream's first chunk itself while its engine is lightly loaded.

Why: a served first chunk otherwise makes two more hops (ingress -> Code2Wav -> ingress) and is decoded in the
Code2Wav process, which time-slices the GPU with the Talker's: on an H100 at one stream its one-frame decode
took 9.4 ms there against ~4 ms in one process, and the hops ~3 ms (docs/benchmarks.md "First audio hop by
hop"). Here it is decoded in the Talker's own CUDA context, on a high-priority stream of its own beside the
engine's steps (as `bench.pipeline` runs the two engines), and travels back with the codec chunk
(`CodecChunk.pcm`); the ingress, or Code2Wav for an unread ObjectRef, takes that PCM instead of decoding.

Exact: the decoder is causal and a stream's first chunk starts from zero state, so this is the samples the
whole decode gives for those frames; Code2Wav then decodes chunk 1 over its left context (the stateful
engine's `fresh` path, the stateless decode), which continues them exactly.

Only while the engine runs at most `max_running` requests: under load the decode would take GPU time from
every running stream's step, and Code2Wav batches first chunks with everything else more cheaply.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from deployments.audio_formats import float_to_pcm16
from stages.contract import CodecChunk

MAX_BATCH = 8  # first chunks decoded together (those waiting while a decode runs)


class FirstChunkDecoder:
    def __init__(self, decoder_model: Any, first_chunk_frames: int, max_running: int, log=print):
        """`decoder_model`: the checkpoint's codec decoder (`Qwen3TTS.decoder`), on the Talker's device."""
        from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig

        self.max_running = max_running
        # one length bucket: first chunks of the configured size without context (a Base ICL first chunk has
        # reference frames as context: longer, so it goes to Code2Wav)
        self.max_frames = first_chunk_frames
        config = Code2WavEngineConfig(max_batch_size=MAX_BATCH, batch_buckets=(1, 2, 4, 8),
                                      length_buckets=(first_chunk_frames,))
        self._engine = Code2WavEngine(decoder_model, config)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="first-chunk-decoder")
        self._stream = None
        self._waiting: list[tuple[CodecChunk, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self._log = log
        self.decoded = 0  # first chunks decoded here

    def start(self) -> None:
        """Graphs for the first-chunk shapes and the stream the decodes run on (blocking: call off the loop)."""
        import torch

        if self._engine.device.type == "cuda":
            # high priority: the decode's kernels go before the engine's queued step kernels
            self._stream = torch.cuda.Stream(self._engine.device, priority=-1)
        t0 = time.perf_counter()
        self._engine.warmup(self._log)
        self._log(f"[talker] first-chunk decoder ready in {time.perf_counter() - t0:.1f} s "
                  f"(chunks of <= {self.max_frames} frames while <= {self.max_running} requests run)")

    def takes(self, chunk: CodecChunk, running: int) -> bool:
        """Whether `chunk` is decoded here: a stream's first chunk, no context, the engine lightly loaded."""
        return (chunk.seq == 0 and chunk.context == 0 and 0 < chunk.num_new <= self.max_frames
                and running <= self.max_running)

    async def decode(self, chunk: CodecChunk) -> np.ndarray:
        """int16 PCM of the chunk's new frames; decodes waiting together share one forward."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((chunk, future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await asyncio.shield(future)  # a cancelled stream must not cancel the others' decode

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            try:
                waves = await loop.run_in_executor(self._executor, self._decode, [c for c, _ in batch])
            except Exception as e:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(e)
                continue
            self.decoded += len(batch)
            for (_, future), wave in zip(batch, waves, strict=True):
                if not future.done():
                    future.set_result(float_to_pcm16(wave))

    def _decode(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        if self._stream is None:
            return self._engine.decode(chunks)
        import torch

        with torch.cuda.stream(self._stream):
            return self._engine.decode(chunks)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False)
