"""Code2WavServer: the shared `Code2Wav` deployment. Any replica decodes any chunk of any stream.

With `engine_kwargs.stateful` the engine keeps each stream's decoder state between its chunks and decodes
only their new frames when they reach the replica that holds it; a chunk of a stream it does not hold is
decoded over its left context, as a stateless replica would (stages/code2wav/stream_slots.py).

`decode_many(chunks)` takes the chunks of many streams at once (an ingress replica's DecodeBatcher
gathers them) and decodes them with the Code2Wav engine, on one thread that owns all of this replica's
decoder work; the engine plans the forwards (padding buckets, CUDA graphs). Calls that arrive while a
decode runs (several ingress replicas, several calls in flight each) wait together and are decoded as one
batch when the thread is free: the GPU sees a few large batches, not one small batch per call. The engine is
whatever `engine_cls` names, used through `Code2WavEngineProtocol` (deployments/code2wav/engine_protocol.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from opentelemetry import trace

from deployments import constants as C
from deployments import first_audio_timing
from deployments.audio.formats import float_to_pcm16
from deployments.coalescing import Coalescer
from deployments.code2wav.engine_protocol import Code2WavEngineProtocol
from deployments.config import CheckpointSource, Code2WavDeploymentConfig, StreamingConfig
from deployments.loading import build_engine, load_model, replica_log, this_replica
from deployments.messages import DecodedChunk, talker_decoded
from deployments.metrics import Code2WavMetrics
from deployments.transport import resolve
from stages.arrival_rate import ArrivalRate
from stages.contract import NUM_CODEBOOKS, CodecChunk

# a span per decode call (docs/serving.md, "Traces"): a no-op unless Serve's tracing is on
tracer = trace.get_tracer("qwen3_tts_serve.code2wav")

DEFAULT_ENGINE_CLS = "stages.code2wav.engine:Code2WavEngine"
IDLE_BELOW_BUSY_SHARE = 0.5  # a decoder busy less than this share of the last second fills with batch_fill_idle_wait_ms


class Code2WavServer:
    async def __init__(self, config: Code2WavDeploymentConfig, source: CheckpointSource, streaming: StreamingConfig):
        self._setup(config, source, streaming)
        await self.start()

    @classmethod
    def sync_init(cls, config: Code2WavDeploymentConfig, source: CheckpointSource,
                  streaming: StreamingConfig) -> Code2WavServer:
        server = cls.__new__(cls)
        server._setup(config, source, streaming)
        return server

    def _setup(self, config: Code2WavDeploymentConfig, source: CheckpointSource, streaming: StreamingConfig) -> None:
        self._config, self._source, self._streaming = config, source, streaming
        self._engine: Code2WavEngineProtocol | None = None
        self._replica: str | None = None  # this replica's id when it keeps stream states (stateful engine)
        self._named = {"here": 0, "elsewhere": 0}  # chunks of calls naming this replica or another (full, gone)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="code2wav")  # the decoder's only thread
        self._inflight = 0  # decode() calls in this replica
        self._decoding = 0  # of which in the batch being decoded
        # heartbeat: when a decode last finished, or work arrived at an idle replica; `check_health` fails
        # when chunks have waited longer than `stall_timeout_s` without one (a stuck device call)
        self._clock = time.monotonic  # tests drive the heartbeat with their own clock
        self._last_progress = self._clock()
        self._metrics: Code2WavMetrics | None = None
        # calls waiting for the decoder thread (each a list of chunks), decoded together
        self._batches: Coalescer[list[CodecChunk], tuple[list[np.ndarray], tuple[float, float]]] = Coalescer(
            self._decode_calls, hold=self._fill_time)
        self._arrivals = ArrivalRate(clock=lambda: self._clock())  # chunks per second lately (batch fill)
        self._busy = ArrivalRate(clock=lambda: self._clock())  # decoding seconds per second lately: its busy share

    def _fill_time(self, calls: list[list[CodecChunk]]) -> float:
        """Seconds the next batch may wait for more chunks (`batch_fill_chunks`): none once it is big enough,
        holds a stream's first two chunks (a listener waits for the first; the second must follow within the
        first's audio), or when chunks arrive too seldom for one more to be expected within the
        wait (light load: waiting would only delay this batch); the later chunks of a stream leave while the
        earlier ones play. Why wait at all: under load, each small decode is a forward of the codec decoder
        beside the Talker's steps on a shared GPU, and fewer, larger ones leave the Talker more of it
        (docs/benchmarks.md). With `batch_fill_idle_wait_ms`, while the decoder was mostly idle lately the wait
        is that one and a last chunk never waits; a busy decoder keeps `batch_fill_wait_ms`, since a batch that
        waits then idles the decoder every stream depends on."""
        cfg = self._config
        if not cfg.batch_fill_chunks:  # off: nothing to count
            return 0.0
        chunks = [c for call in calls for c in call]
        if len(chunks) >= cfg.batch_fill_chunks or any(c.seq < C.WAITED_FOR_CHUNKS for c in chunks):
            return 0.0
        idle = cfg.batch_fill_idle_wait_ms > 0 and self._busy.per_second() < IDLE_BELOW_BUSY_SHARE
        if idle and any(c.final for c in chunks):
            return 0.0
        wait_ms = cfg.batch_fill_idle_wait_ms if idle else cfg.batch_fill_wait_ms
        return self._arrivals.wait_if_more_expected(wait_ms / 1000)

    async def start(self) -> None:
        cfg = self._config
        log = replica_log(C.CODE2WAV_DEPLOYMENT_NAME)
        model, device = await load_model(cfg, self._source, log, talker=False, decoder=True, voice=False)
        stateful = cfg.stateful
        lengths = self._streaming.schedule().graph_lengths(stateful)  # the chunk shapes worth a CUDA graph
        engine_kwargs = {"max_batch_size": cfg.max_batch_size, "length_buckets": lengths, **cfg.engine_config_kwargs()}
        self._engine = await self._on_thread(build_engine, cfg.engine_cls or DEFAULT_ENGINE_CLS, model.decoder,
                                             engine_kwargs)
        if cfg.warmup:  # graph capture (CUDA), then one real batch of every chunk length of the schedule
            await self._on_thread(self._engine.warmup, log)
            t0 = time.perf_counter()
            chunks = [CodecChunk(f"warmup-{i}", 0, np.zeros((n, NUM_CODEBOOKS), dtype=np.int64), 0, final=True)
                      for i, n in enumerate(lengths)]  # final: a stateful engine keeps no slot for them
            await self._on_thread(self._engine.decode, chunks)
            log(f"warm-up decode of lengths {lengths} done in {time.perf_counter() - t0:.2f} s")
        self._replica = this_replica() if stateful else None  # where the answers say a stream's state is
        self._metrics = Code2WavMetrics()
        log(f"ready on {device} ({model.dtype}), batches of up to {cfg.max_batch_size} chunks"
            + (f", stateful ({self._engine.config.state_slots} stream slots)" if stateful else ""))

    async def decode_many(self, chunks: list, replica: str | None = None) -> list[DecodedChunk | Exception]:
        """PCM (int16) of each chunk's new frames, decoded together; one answer per chunk, in order.

        `chunks` are CodecChunks or ObjectRefs to them (the Talker's stream items, forwarded unread by
        the ingress's DecodeBatcher). A chunk that cannot be used (malformed, or its ref holds the
        Talker's error) gets its exception in its place; the others are decoded. `replica`: the replica the
        caller named for these chunks' streams (deployments/ingress/placement.py: Code2Wav's request router reads
        it); a stateful replica's answers name itself, where their streams' state now is.
        """
        n = len(chunks)
        t0, arrived = time.perf_counter(), first_audio_timing.now()
        if replica is not None:  # named calls that reached their replica, and those the router sent elsewhere
            landed = "here" if replica == self._replica else "elsewhere"
            self._named[landed] += n
            self._metrics.named_chunks.inc(n, tags={"landed": landed})
        self._arrivals.add(n)
        if self._inflight == 0:
            self._last_progress = self._clock()
        self._inflight += n
        self._metrics.queued_chunks.set(self._inflight - self._decoding)
        try:
            resolved = await asyncio.gather(*(resolve(c) for c in chunks), return_exceptions=True)
            answers: list[DecodedChunk | Exception | None] = [None] * n
            valid = []
            for i, chunk in enumerate(resolved):
                if isinstance(chunk, Exception):
                    answers[i] = chunk
                    continue
                if (decoded := talker_decoded(chunk)) is not None:  # a forwarded ref to PCM the Talker made
                    answers[i] = decoded
                    continue
                try:
                    self._engine.check_chunk(chunk, i)  # a malformed chunk fails alone, not the whole call
                except ValueError as e:
                    answers[i] = e
                    continue
                valid.append(i)
            if valid:
                # the call's chunks are of many streams: the span, a child of the caller's, names them all
                with tracer.start_as_current_span("code2wav.decode", attributes={
                        "tts.chunks": len(valid), "tts.frames": sum(resolved[i].num_new for i in valid),
                        "tts.engine_request_ids": sorted({resolved[i].request_id for i in valid})}):
                    waves, span = await self._decode_together([resolved[i] for i in valid])
                for i, wave in zip(valid, waves, strict=True):
                    c = resolved[i]
                    stamps = (arrived, *span) if c.seq == 0 else ()  # a stream's first chunk: Server-Timing
                    answers[i] = DecodedChunk(c.request_id, c.seq, float_to_pcm16(wave), c.final, c.finish_reason,
                                              stamps, self._replica)
            return answers  # type: ignore[return-value]
        finally:
            self._inflight -= n
            self._metrics.queued_chunks.set(self._inflight - self._decoding)
            self._metrics.call_latency_ms.observe((time.perf_counter() - t0) * 1000)

    async def decode(self, chunk: CodecChunk) -> DecodedChunk:
        """One chunk (tests, direct callers); the ingress sends batches through `decode_many`."""
        (answer,) = await self.decode_many([chunk])
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def _decode_together(self, chunks: list[CodecChunk]) -> tuple[list[np.ndarray], tuple[float, float]]:
        """The waves of `chunks`, decoded in one batch with those of every call waiting meanwhile, and the
        batch's (start, end) wall times."""
        return await self._batches.submit(chunks)

    async def _decode_calls(self, calls: list[list[CodecChunk]]) -> list[tuple[list[np.ndarray], tuple[float, float]]]:
        """One batch of the chunks of `calls` -> per call, its waves and the batch's wall times."""
        work = [chunk for chunks in calls for chunk in chunks]
        t0 = time.perf_counter()
        waves, span = await self._on_thread(self._decode_on_thread, work)
        self._busy.add(time.perf_counter() - t0)
        self._metrics.batch_size.observe(len(work))
        answers, start = [], 0
        for chunks in calls:
            answers.append((waves[start:start + len(chunks)], span))
            start += len(chunks)
        return answers

    def _decode_on_thread(self, chunks: list[CodecChunk]) -> tuple[list[np.ndarray], tuple[float, float]]:
        self._decoding += len(chunks)
        t0, started = time.perf_counter(), first_audio_timing.now()
        try:
            waves = self._engine.decode(chunks, checked=True)  # decode_many checked each chunk already
            return waves, (started, first_audio_timing.now())
        finally:
            self._last_progress = self._clock()
            self._decoding -= len(chunks)
            self._metrics.batch_decode_ms.observe((time.perf_counter() - t0) * 1000)
            if self._engine.stateful:
                self._metrics.record_state_paths(self._engine.stats())

    async def ready(self) -> bool:
        return self._engine is not None

    async def engine_stats(self) -> dict:
        """The engine's counters (`Code2WavStats`: decode calls, chunks, frames new / decoded / padded, busy
        seconds), which replica answered (`replica`) and the chunks of calls that named this replica or another
        one (`named_here`, `named_elsewhere`: stream affinity), read twice over a window by the bench's replica
        stats."""
        return {"replica": this_replica(), **dataclasses.asdict(self._engine.stats()),
                **{f"named_{landed}": chunks for landed, chunks in self._named.items()}}

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: chunks pending and no decode finished for too long."""
        if self._engine is None:
            raise RuntimeError("the Code2Wav engine is not running")
        stalled_for = self._clock() - self._last_progress
        if self._inflight > 0 and stalled_for > self._config.stall_timeout_s:
            raise RuntimeError(f"Code2Wav made no progress for {stalled_for:.0f} s with {self._inflight} chunks pending")

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {
            "queued_chunks": float(self._inflight - self._decoding),
            "inflight_chunks": float(self._inflight),
            "max_batch_size": float(self._config.max_batch_size),
        }

    def __del__(self) -> None:
        self._executor.shutdown(wait=False)

    async def _on_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
