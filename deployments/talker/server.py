"""TalkerServer: the `Talker:<model>` deployment, a thin shim over one talker engine per replica.

It streams codec chunks (with left context) of one request: the engine cuts them by the serving
schedule in its loop (where the frames are) and the chunks leave as the stream's items (by value over
Serve's gRPC transport, or as refs the ingress forwards unread: deployments/transport.py). The engine is
whatever `engine_cls` names, used through `TalkerEngineProtocol` (deployments/talker/engine_protocol.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path

import numpy as np
from opentelemetry import trace

from deployments import constants as C
from deployments import first_audio_timing
from deployments.config import StreamingConfig, TalkerDeploymentConfig
from deployments.errors import replica_failed
from deployments.loading import build_engine, load_model, replica_log, this_replica
from deployments.loop_lag import LoopLag
from deployments.messages import Admitted, CallItem, GenerateOptions, ModelInfo, ReplicaFullError
from deployments.metrics import TalkerMetrics
from deployments.talker.engine_protocol import EngineStream, TalkerEngineProtocol
from deployments.talker.first_chunk_decoder import FirstChunkDecoder
from deployments.talker.text_pump import LiveTextPump
from stages.chunking import ChunkSchedule
from stages.contract import (
    CodecChunk,
    SamplingParams,
    SynthesisRequest,
    TaskType,
    VoiceClonePrompt,
)

logger = logging.getLogger("ray.serve")
# spans of a request's admission and first chunk (docs/serving.md, "Traces"): no-ops unless Serve's tracing is on
tracer = trace.get_tracer("qwen3_tts_serve.talker")

DEFAULT_ENGINE_CLS = "stages.talker.engine:TalkerEngine"


class TalkerServer:
    """Owns a loaded checkpoint (talker, tokenizer, voice encoders for Base) and its engine."""

    async def __init__(self, config: TalkerDeploymentConfig, streaming: StreamingConfig):
        self._setup(config, streaming)
        await self.start()

    @classmethod
    def sync_init(cls, config: TalkerDeploymentConfig, streaming: StreamingConfig) -> TalkerServer:
        """Build without Serve (tests): `server = TalkerServer.sync_init(...); await server.start()`."""
        server = cls.__new__(cls)
        server._setup(config, streaming)
        return server

    def _setup(self, config: TalkerDeploymentConfig, streaming: StreamingConfig) -> None:
        self._config = config
        self._streaming = streaming
        self._engine: TalkerEngineProtocol | None = None
        self._model = None
        self._info: ModelInfo | None = None
        self._first_decoder: FirstChunkDecoder | None = None
        self._first_decoder_build: asyncio.Task | None = None
        self._metrics_task: asyncio.Task | None = None
        self._metrics: TalkerMetrics | None = None
        self._loop_lag = LoopLag()  # this replica's event loop: every call's start and streamed item wait on it
        self._open: dict[str, EngineStream] = {}  # the streams of requests in this replica, by request id
        self._text_pumps: dict[object, LiveTextPump] = {}  # batched requests' text and closes, by their mailbox
        self._max_ongoing_requests = config.max_ongoing_requests  # per speech request here: Serve's bounds calls
        self._live_open = 0  # of `_open`: live requests (a parked one takes no engine slot: not bounded with speech)

    async def start(self) -> None:
        """Load the checkpoint, start the engine (KV sizing, graph capture), warm up with one real request."""
        cfg = self._config
        log = replica_log(cfg.deployment_name)
        decode_first = cfg.decodes_first_chunks
        model, device = await load_model(cfg, cfg.source, log, talker=True, decoder=decode_first, voice=True)
        self._model = model
        engine_kwargs = cfg.engine_config_kwargs()
        self._engine = build_engine(cfg.engine_cls or DEFAULT_ENGINE_CLS, model, engine_kwargs)
        await asyncio.to_thread(self._engine.start, log, C.TALKER_ENGINE_START_TIMEOUT_S)
        self._schedule = self._streaming.schedule()
        if decode_first:
            self._first_decoder = FirstChunkDecoder(model.decoder, self._schedule,
                                                    cfg.first_chunk_decode_max_running, log,
                                                    count_pending=cfg.first_chunk_decode_count_pending,
                                                    max_batch=cfg.first_chunk_decode_max_batch,
                                                    # compiled where the Talker's engine is (fewer kernels)
                                                    compile=cfg.first_chunk_decode_compile
                                                    and self._engine.config.compile,
                                                    compile_cache_dir=engine_kwargs.get("compile_cache_dir"))
            # built while the replica serves (first chunks go to Code2Wav meanwhile): not on the way to ready
            self._first_decoder_build = asyncio.get_running_loop().create_task(self._build_first_decoder())
        self._info = ModelInfo(
            name=cfg.name, aliases=tuple(cfg.aliases), config=model.config, generation=model.generation,
            tokenizer=model.tokenizer, max_seq_len=int(self._engine.config.max_seq_len),
            max_text_rows=int(self._engine.config.max_text_rows),
            fingerprint=_fingerprint(model.path), default_max_new_tokens=cfg.default_max_new_tokens,
        )
        if cfg.warmup:
            t0 = time.perf_counter()
            await self._warmup()
            log(f"[talker] warm-up request done in {time.perf_counter() - t0:.2f} s")
        self._metrics = TalkerMetrics(cfg.name)
        self._metrics_task = asyncio.get_running_loop().create_task(self._refresh_metrics())
        self._loop_lag.start()
        log(f"[talker] {cfg.name} ready: {model.config.task.value} on {device} ({model.dtype})")

    # ------------------------------------------------------------------ requests
    async def info(self) -> ModelInfo:
        return self._info

    async def ready(self) -> bool:
        return self._engine is not None and self._engine.ready

    async def first_chunk_decoder_built(self) -> bool:
        """Wait until this replica's first-chunk decoder is built; whether it takes chunks (False: it has none, or
        its build failed)."""
        if self._first_decoder_build is not None:
            await asyncio.shield(self._first_decoder_build)
        return self._first_decoder is not None and self._first_decoder.ready

    async def generate(
        self, request: SynthesisRequest, options: GenerateOptions | None = None
    ) -> AsyncGenerator[CodecChunk, None]:
        """Stream the request's codec chunks in order; the last one has `final=True` and the finish reason.

        Cancelling the consumer (client gone, deadline) aborts the request in the engine, which frees
        its slot at the next step.
        """
        started = first_audio_timing.now()
        options = options or GenerateOptions()
        with tracer.start_as_current_span("talker.admission", attributes={"tts.engine_request_id": request.request_id}):
            stream = self._engine.add_request(request, self._schedule_for(options))  # chunks are cut in the engine loop
        self._open[request.request_id] = stream
        try:
            async for chunk in self._leaving(stream, started, request.request_id):
                yield chunk
        finally:
            self._open.pop(request.request_id, None)
            await stream.aclose()  # no-op after a normal end; aborts the request otherwise

    async def generate_many(
        self, batch: list[tuple[SynthesisRequest, GenerateOptions]], mailbox
    ) -> AsyncGenerator[list[CallItem], None]:
        """Speech requests started together: one Serve call for a batch of them, which the calling ingress replica
        formed from the requests it started while its previous batch was being admitted
        (deployments/ingress/talker_calls.py), so a burst of arrivals costs this replica a few calls, not one each.

        Yields lists of `CallItem`: whatever is ready at once, of any of the batch's requests. Each request's items
        are its `Admitted` (the engine took it), then `generate`'s chunks, then an item that says it ended; a request
        that fails or is refused ends with its error instead, the others go on. A request beyond this replica's
        `max_ongoing_requests` open speech requests (Serve's bound counts calls, not the requests in them) is refused
        with `ReplicaFullError`, which the ingress sends again later (Serve may route it elsewhere). The call ends
        when every request has; cancelling it aborts those still running. Closing a request's box in `mailbox` (the
        calling ingress replica's `TextMailbox`: its client left) aborts that request alone."""
        # closed here, not when the loop finalizes it: a cancelled call aborts its requests at once
        async with contextlib.aclosing(self._many(batch, functools.partial(self._speech, mailbox=mailbox))) as calls:
            async for items in calls:
                yield items

    async def generate_live_many(
        self, batch: list[tuple[SynthesisRequest, GenerateOptions]], mailbox
    ) -> AsyncGenerator[list[CallItem], None]:
        """Live requests (WebSocket contexts) started together, batched as `generate_many`'s. Each request's items
        are `generate`'s for a request whose text arrives while it runs. Each request's prompt has no text
        (`stages.prompts.build_live_prompt`): it comes from `mailbox` (the calling ingress replica's `TextMailbox`,
        deployments/text_mailbox.py), where the ingress puts the context's append/flush/end events, and where
        closing the request's box aborts it alone."""
        # closed here, not when the loop finalizes it: a cancelled call aborts its requests at once
        async with contextlib.aclosing(self._many(batch, functools.partial(self._live, mailbox=mailbox))) as calls:
            async for items in calls:
                yield items

    async def _many(self, batch: list[tuple[SynthesisRequest, GenerateOptions]], run_one
                    ) -> AsyncGenerator[list[CallItem], None]:
        """A batched call's stream: each request's items from `run_one(request, options)` (an async iterator), then
        its end or its error, in lists of whatever is ready at once."""
        ready: asyncio.Queue[CallItem] = asyncio.Queue()

        async def run(request: SynthesisRequest, options: GenerateOptions) -> None:
            try:
                async for item in run_one(request, options):
                    ready.put_nowait(CallItem(request.request_id, item))
                ready.put_nowait(CallItem(request.request_id))  # its end
            except Exception as e:  # refused or failed: this request's last item
                ready.put_nowait(CallItem.failed(request.request_id, e))

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(run(request, options)) for request, options in batch]
        running = len(tasks)
        try:
            while running:
                items = [await ready.get()]
                while not ready.empty():  # one message for everything ready now
                    items.append(ready.get_nowait())
                running -= sum(item.item is None for item in items)  # each request's last item: its end or error
                yield items
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _speech(
        self, request: SynthesisRequest, options: GenerateOptions, mailbox
    ) -> AsyncGenerator[CodecChunk | Admitted, None]:
        """One speech request of `generate_many`: `Admitted`, then its chunks. This replica's pump for `mailbox`
        watches its box: a close (the ingress's reader stopped) aborts it."""
        started = first_audio_timing.now()
        if len(self._open) - self._live_open >= self._max_ongoing_requests:
            raise ReplicaFullError(f"{self._max_ongoing_requests} speech requests already open in this replica")
        with tracer.start_as_current_span("talker.admission", attributes={"tts.engine_request_id": request.request_id}):
            stream = self._engine.add_request(request, self._schedule_for(options))
        async with self._watched(request.request_id, stream, mailbox):
            yield Admitted(request.request_id)
            async for chunk in self._leaving(stream, started, request.request_id):
                yield chunk

    async def _live(
        self, request: SynthesisRequest, options: GenerateOptions, mailbox
    ) -> AsyncGenerator[CodecChunk | Admitted, None]:
        """One live request of `generate_live_many`: `Admitted`, then its chunks. Its text comes through this
        replica's pump for `mailbox` (deployments/talker/text_pump.py), which takes the events of all its requests
        there in one poll and hands them to the engine; the engine waits for text without stepping the request."""
        started = first_audio_timing.now()
        with tracer.start_as_current_span("talker.admission", attributes={"tts.engine_request_id": request.request_id}):
            stream = self._engine.open_request(request, self._schedule_for(options),
                                               idle_timeout_s=options.text_idle_timeout_s)
        self._live_open += 1
        try:
            async with self._watched(request.request_id, stream, mailbox) as pump:
                yield Admitted(request.request_id)
                async for chunk in self._leaving(stream, started, request.request_id):
                    # the live first audio's `to_talker_text` ends where its first text reached the engine
                    if chunk.seq == 0 and (text_in := pump.first_text_at(request.request_id)) is not None:
                        chunk = dataclasses.replace(chunk, stamps={**chunk.stamps, "text_in": text_in})
                    yield chunk
        finally:
            self._live_open -= 1

    @contextlib.asynccontextmanager
    async def _watched(self, request_id: str, stream: EngineStream, mailbox) -> AsyncIterator[LiveTextPump]:
        """A batched request while it runs here: open, its box in `mailbox` taken by this replica's pump for it (its
        text, and its close); at the end it leaves both, and its stream closes (aborting it if it still runs)."""
        pump = self._text_pumps.get(mailbox)
        if pump is None:
            pump = self._text_pumps[mailbox] = LiveTextPump(self._engine, mailbox)
        pump.add(request_id)
        self._open[request_id] = stream
        try:
            yield pump
        finally:
            self._open.pop(request_id, None)
            pump.remove(request_id)
            if not pump.requests:
                self._text_pumps.pop(mailbox, None)
            await stream.aclose()

    async def _leaving(self, stream, started: float, request_id: str) -> AsyncGenerator[CodecChunk, None]:
        """The engine's chunks of one request as they leave this replica (chunks 0 and 1 via `_early_chunk`).
        The `talker.first_chunk` span runs from the admission to the first chunk leaving (queue, prefill, its
        frames, and its decode when this replica decodes it)."""
        first = None
        span = tracer.start_span("talker.first_chunk", attributes={"tts.engine_request_id": request_id})
        try:
            async for chunk in stream:
                if chunk.seq <= 1:
                    chunk = await self._early_chunk(chunk, started, first)
                    if first is None:
                        span.set_attributes({"tts.frames": chunk.num_new, "tts.decoded_here": chunk.pcm is not None})
                        span.end()
                    first = first or chunk
                yield chunk
        finally:
            if first is None:  # failed or cancelled before its first chunk
                span.end()

    async def _early_chunk(self, chunk: CodecChunk, started: float, first: CodecChunk | None) -> CodecChunk:
        """A stream's chunk 0 or 1 as it leaves: with its PCM when this replica decodes it (lightly loaded:
        deployments/talker/first_chunk_decoder.py); the first also with this replica's times (Server-Timing)."""
        cut, decoder, pcm = first_audio_timing.now(), self._first_decoder, None
        if decoder is not None and decoder.takes(chunk, self._engine.stats().running, first):
            pcm = await decoder.decode(chunk)
        stamps = {**chunk.stamps, "started": started, "cut": cut, "left": first_audio_timing.now()} if chunk.seq == 0 else {}
        return dataclasses.replace(chunk, pcm=pcm, stamps=stamps)

    def _schedule_for(self, options: GenerateOptions) -> ChunkSchedule:
        """The deployment's chunk schedule, with the request's own first chunk when it asks for one."""
        if options.first_chunk_frames is None:
            return self._schedule
        return dataclasses.replace(self._schedule, first_chunk_frames=options.first_chunk_frames)

    async def create_voice(self, audio: bytes, ref_text: str | None, x_vector_only: bool) -> VoiceClonePrompt:
        """Reference clip (+ transcript) -> the Base model's voice-clone prompt (speaker + codec encoders).

        Raises InvalidRequestError (a ValueError) for audio it cannot use or a model that is not Base. Runs on
        the engine's device thread: one thread owns all of the replica's GPU work.
        """
        from stages.voice.prompt import create_voice_clone_prompt

        work = functools.partial(create_voice_clone_prompt, self._model, audio, ref_text, x_vector_only)
        return await asyncio.wrap_future(self._engine.run_on_device(work))

    async def engine_stats(self) -> dict:
        """The engine's counters (`EngineStats`) and which replica answered (`replica`: a window read twice by
        the bench's replica stats must come from one replica), with the first-chunk decoder's (`Code2WavStats`:
        its forwards share this replica's GPU with the engine's steps) when it has one, and its event loop's lag
        (`event_loop_lag`: deployments/loop_lag.py)."""
        stats = {"replica": this_replica(), **dataclasses.asdict(self._engine.stats()),
                 "recent_steps": self._engine.recent_steps(), "event_loop_lag": self._loop_lag.snapshot()}
        if self._first_decoder is not None:
            stats["first_chunk_decoder"] = dataclasses.asdict(self._first_decoder.stats())
        return stats

    # ------------------------------------------------------------------ Serve hooks
    def check_health(self) -> None:
        """Serve replaces the replica when this raises: an engine that died, or one that made no step for too
        long while work was pending (the engine's heartbeat: a thread stuck in a device call looks alive to
        `ready` alone). Then every stream of this replica ends now with a 503 (the client sees its failure and may
        retry elsewhere): a stuck engine would never end them, and Serve's graceful stop would wait for them."""
        try:
            if self._engine is None or not self._engine.ready:
                raise RuntimeError(f"talker engine of {self._config.name} is not running")
            self._engine.check_health()
        except Exception as exc:
            if self._open:
                logger.error(f"{exc}; ending this replica's {len(self._open)} streams")
                failed = replica_failed()
                for stream in list(self._open.values()):
                    stream.fail(failed)
            raise

    def record_autoscaling_stats(self) -> dict[str, float]:
        s = self._engine.stats()
        # a live request waiting for text keeps its slot (parked); one not prefilled yet (held) takes none
        return {"waiting": float(s.waiting), "running": float(s.running + s.parked), "slots": float(s.max_running)}

    def __del__(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        self._loop_lag.stop()
        if self._engine is not None:
            self._engine.shutdown()
        if self._first_decoder is not None:
            self._first_decoder.shutdown()

    # ------------------------------------------------------------------ internals
    async def _build_first_decoder(self) -> None:
        # Serve collects and freezes what a replica holds once its __init__ returns, so that later collections do not
        # walk it (docs/serving.md, "Garbage collections"); the decoder's compiles came after that, and left ~10^5
        # objects that every full collection then walked, stopping the engine with the loop (200-270 ms each, about
        # one a minute under load): collected and frozen as well, once, in the build's thread, before the decoder
        # says it is ready (a collection stops the process: the log line that marks a warm replica comes after it)
        await self._first_decoder.build(then=_collect_and_freeze)

    async def _warmup(self) -> None:
        from stages.prompts import build_prompt

        cfg = self._model.config
        speaker = instruct = voice = None
        if cfg.task is TaskType.CUSTOM_VOICE:
            speaker = sorted(cfg.talker.speakers)[0]
        elif cfg.task is TaskType.VOICE_DESIGN:
            instruct = "A calm voice."
        else:
            voice = VoiceClonePrompt(x_vector=np.zeros(cfg.talker.hidden_size, dtype=np.float32))
        prompt = build_prompt(cfg, self._model.tokenizer, "Warm-up.", speaker=speaker, instruct=instruct, voice=voice)
        request = SynthesisRequest(f"warmup-{uuid.uuid4().hex}", prompt, SamplingParams(suppress_eos=True),
                                   max_frames=C.WARMUP_FRAMES, seed=0)
        async for _chunk in self.generate(request):
            pass

    async def _refresh_metrics(self) -> None:
        m, last_steps, last_frames = self._metrics, 0, 0
        while True:
            s = self._engine.stats()
            m.waiting.set(s.waiting)
            m.running.set(s.running + s.parked)
            m.waiting_for_text.set(s.parked + s.held)
            m.slots.set(s.max_running)
            m.kv_usage.set(s.kv_reserved_tokens / s.kv_total_tokens if s.kv_total_tokens else 0.0)
            if s.frames > last_frames:
                m.frames.inc(s.frames - last_frames)
            if s.steps > last_steps:
                m.mean_batch_size.observe((s.frames - last_frames) / (s.steps - last_steps))
            last_steps, last_frames = s.steps, s.frames
            await asyncio.sleep(C.METRICS_REFRESH_INTERVAL_S)


def _collect_and_freeze() -> None:
    gc.collect()
    gc.freeze()


def _fingerprint(path: Path) -> str:
    """Identifies a checkpoint's weights (config + weight file identity), for caches keyed by model."""
    h = hashlib.sha256(str(Path(path).resolve()).encode())
    h.update((Path(path) / "config.json").read_bytes())
    weights = (Path(path) / "model.safetensors").stat()
    h.update(f"{weights.st_size}:{weights.st_mtime_ns}".encode())
    return h.hexdigest()[:16]
