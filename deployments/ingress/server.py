"""TTSIngress: the OpenAI-compatible HTTP API of the app, a plain class (CPU only).

Its methods answer the routes of `deployments/ingress/app.py`'s `ENDPOINTS`; `make_fastapi_ingress` turns
the class into a Serve ingress when the application is built. A speech request is admitted, validated and
tokenized (with the tokenizer each Talker sends once), routed by `model` to that checkpoint's Talker
deployment, given its voice, and started: Code2Wav decodes of the Talker's chunks are pipelined
(`deployments.ingress.pipeline`), and once the first audio is in hand a writer (deployments/ingress/speech.py)
sends one body, raw chunked bytes, or SSE events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi import Request, WebSocket
from fastapi.responses import Response
from opentelemetry import trace
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import constants as C
from deployments import first_audio_timing
from deployments.audio.encoders import check_codecs
from deployments.config import TTSServingArgs
from deployments.errors import APIError
from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress import routing
from deployments.ingress.api_keys import ApiKey
from deployments.ingress.auth import Auth, caller
from deployments.ingress.batch_jobs import BatchJobs
from deployments.ingress.batch_store import BatchStore
from deployments.ingress.batch_worker import BatchWorker
from deployments.ingress.decode_batcher import DecodeBatcher
from deployments.ingress.http_guard import OpenWork
from deployments.ingress.live import LiveAuth, LiveSession
from deployments.ingress.long_form import long_form_chunks
from deployments.ingress.long_text import PiecePlanner, PlannedPiece, client_capped
from deployments.ingress.outcomes import Outcomes
from deployments.ingress.pipeline import stream_audio
from deployments.ingress.placement import StreamPlacement
from deployments.ingress.rate_limits import KeyLimits, held_until_sent
from deployments.ingress.request_builder import VoiceChoice, build_request, check_limits, check_request
from deployments.ingress.request_log import RequestRecord, key_hash
from deployments.ingress.routing import ModelRouter
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.socket_limits import SocketLimits
from deployments.ingress.speech import SpeechJob, stream_response, whole_response
from deployments.ingress.talker_calls import TalkerCalls
from deployments.ingress.timestamps import ResponseTimestamps, check_language, no_aligner
from deployments.ingress.voice_store import VoiceStore
from deployments.ingress.voices import Voices
from deployments.ingress.websocket_deflate import decline_permessage_deflate
from deployments.loading import this_replica
from deployments.loop_lag import LoopLag
from deployments.messages import AlignerInfo, AlignRequest, DecodedChunk, GenerateOptions, ModelInfo
from deployments.metrics import BatchMetrics
from deployments.text_mailbox import MailboxWriter, new_mailbox
from deployments.transport import max_answer_bytes, stage_handle
from stages.aligner.timestamps import Word
from stages.contract import FRAME_SECONDS, Priority, SynthesisRequest


class TTSIngress:
    # The endpoint methods' docstrings are the OpenAPI document's operation descriptions: only `ready` has one.

    async def __init__(self, talkers: dict[str, DeploymentHandle], code2wav: DeploymentHandle, args: TTSServingArgs,
                       aligner: DeploymentHandle | None = None):
        limits = args.ingress
        # before Serve starts this replica's own HTTP server (after __init__): audio frames sent uncompressed
        decline_permessage_deflate()
        self._args, self._limits, self._code2wav = args, limits, code2wav
        self.aligner = aligner  # the Aligner deployment (word timestamps); None where `aligner:` is not configured
        self._aligner: AlignerInfo | None = None  # what it times (asked once)
        check_codecs()  # a replica that cannot encode OpenAI's default format must not start
        self._router = ModelRouter(talkers, args.models, limits.voice_aliases)
        self._auth = Auth(limits.auth)  # the WebSocket's checks; HTTP requests are checked by AuthGuard (app.py)
        self._key_limits = KeyLimits(_app_name(), limits.request_timeout_s)
        self._outcomes = Outcomes(limits.backpressure, self._router.routes)
        self._work = OpenWork(limits.max_open_requests, limits.backpressure.retry_after_s,
                              limits.backpressure.status_code)
        self._decoder = DecodeBatcher(stage_handle(code2wav, limits.stage_transport), limits.decode_batch.max_chunks,
                                      limits.decode_batch.max_calls_in_flight, max_answer_bytes(limits.stage_transport),
                                      self._placement(args))
        self._voices = Voices(VoiceStore(limits.voices_path), self._router, limits, self._work, self._outcomes)
        self._router.prefetch()
        # this replica's TextMailbox (WebSocket live text), started with the replica: made with the first
        # WebSocket context instead, it costs that context's first audio an actor's worker start (seconds;
        # docs/benchmarks.md "Live text")
        self._sockets = SocketLimits(limits.max_websockets_per_replica, limits.max_websockets_per_client)
        self._mailbox = MailboxWriter(new_mailbox())
        # by (model, live): this replica's speech and live requests, batched into Talker calls
        self._talker_calls: dict[tuple[str, bool], TalkerCalls] = {}
        await self._mailbox.handle.open_boxes.remote()
        # batch jobs: this replica's worker resumes what the shared store holds (deployments/ingress/batch_worker.py)
        batch = limits.batch
        store = BatchStore(batch.store_path(serve.get_replica_context().app_name), batch.journal_mode, batch.lease_s,
                           batch.max_attempts)
        self._batch_worker = BatchWorker(store, batch, self._batch_item_chunks, limits.request_timeout_s,
                                         BatchMetrics().record)
        self._batches = BatchJobs(store, batch, self._check_batch_item, self._batch_worker,
                                  limits.default_response_format)
        self._batch_worker.start()
        self._loop_lag = LoopLag()  # every socket's messages and every stream's items wait on this loop
        self._loop_lag.start()

    @staticmethod
    def _placement(args: TTSServingArgs) -> StreamPlacement | None:
        """Where each stream's Code2Wav state is, with stream affinity (None: every decode call by load)."""
        if not args.stream_affinity:
            return None
        return StreamPlacement()

    @property
    def args(self) -> TTSServingArgs:
        return self._args

    # ------------------------------------------------------------------ speech
    async def speech(self, body: SpeechRequest, request: Request):
        key = caller(request)
        body = body.with_default_format(self._limits.default_response_format)
        record = RequestRecord(f"speech-{uuid.uuid4().hex}", "speech", len(body.input), body.streaming,
                               voice=body.voice, key_hash=key_hash(request.headers.get("authorization"),
                                                                   request.query_params.get("api_key")))
        try:
            admission = await self._key_limits.admit(key, stream=True)  # the key's limits (rate_limits.py)
        except APIError as exc:
            return self._outcomes.fail(exc, "-", body.streaming, record)
        try:
            self._work.acquire()  # admission of the costly part (deployments/ingress/http_guard.py)
        except APIError as exc:
            admission.release()
            return self._outcomes.fail(exc, "-", body.streaming, record)
        try:
            # calls to the Talker and Code2Wav carry the request's span: theirs are its children (Serve propagates it)
            with trace.use_span(record.span, end_on_exit=False):
                response = await self._speech(body, record, key)
        except BaseException:
            admission.release()
            raise
        finally:
            self._work.release()  # a stream holds its own count while it is sent
        return held_until_sent(response, admission.release)

    async def _speech(self, body: SpeechRequest, record: RequestRecord, key: ApiKey | None = None) -> Response:
        started, timing = record.started, FirstAudioTiming(arrived=first_audio_timing.now())
        loop = asyncio.get_running_loop()
        started_loop = loop.time()
        deadline = started_loop + min(body.timeout_s or self._limits.request_timeout_s, self._limits.request_timeout_s)
        request_id = record.engine_request_id
        model = "-"  # metric tag: a served name only (never a client-chosen string)
        chunks: AsyncIterator[DecodedChunk] | None = None
        try:
            check_limits(body, self._limits)
            await self.check_timestamps(body)
            # validation first, then the client's deadline: a tiny `timeout_s` must not hide a 400
            info, voice_choice = await self.route(body, key)
            model = record.model = info.name
            check_request(body, info, self._args)
            async with asyncio.timeout_at(deadline):
                started_speech = await self._start_speech(body, info, voice_choice, request_id, timing,
                                                          deadline - loop.time(), timed=body.timestamps is not None)
                chunks = started_speech.chunks
                first = await anext(chunks, None)
        except BaseException as exc:  # every failure before the first audio is one JSON error
            if chunks is not None:
                await chunks.aclose()
            if isinstance(exc, asyncio.CancelledError):
                self._outcomes.count(model, "cancelled", body.streaming, record)
                raise
            return self._outcomes.fail(exc, model, body.streaming, record)
        pieces = started_speech.pieces
        if pieces > 1:  # each piece has the request's time from when it is sent (deployments/ingress/long_form.py)
            deadline += (pieces - 1) * (deadline - started_loop)
        job = SpeechJob(body, model, chunks, first, deadline, started, usage_in=started_speech.usage_in, record=record,
                        client_capped=started_speech.client_capped, pieces=pieces, cut_pieces=started_speech.cut_pieces)
        job.timestamps = self.timestamps(body, started_speech.texts)
        timing.responded = first_audio_timing.now()
        self._outcomes.first_audio_stages(model, timing)
        # Serve's proxy adds X-Request-Id (the client's own, or a new one); Server-Timing: where first audio went
        headers: dict[str, str] = {"Server-Timing": timing.header()}
        if body.streaming:
            return stream_response(job, self._outcomes, self._work, headers)
        return await whole_response(job, self._outcomes, headers)

    async def route(self, body: SpeechRequest, key: ApiKey | None = None) -> tuple[ModelInfo, VoiceChoice]:
        """The request's model and voice (an uploaded voice only if `key` may use it). Waits only for a model's
        info (fetched once per replica) and a voice lookup on disk (in a thread), bounded by the server's deadline."""
        async with asyncio.timeout(self._limits.request_timeout_s):
            find_voice = await self._voices.finder(body, key)
            return await self._router.route(body, find_voice)

    async def voice_prompt(self, body: SpeechRequest, info: ModelInfo, voice_choice: VoiceChoice):
        """The request's voice-clone prompt (Base; None otherwise), resolved once for all its Talker requests."""
        return await self._voices.prompt(body, info, voice_choice)

    def start_live(self, body: SpeechRequest, info: ModelInfo, voice_choice: VoiceChoice, voice, request_id: str,
                   idle_timeout_s: float | None = None, frame_cap: int | None = None,
                   timing: FirstAudioTiming | None = None,
                   ) -> tuple[SynthesisRequest, int, AsyncIterator[DecodedChunk]]:
        """One live request of a WebSocket context (deployments/ingress/live_pieces.py): the engine's request, the
        frames that fit it (`max_seq_len`; its cap had the client set none), and its decoded-chunk pipeline (nothing
        runs until its first item is awaited); it goes to the Talker in a batch of this replica's live requests
        (`TalkerCalls`), its text through this replica's mailbox. `frame_cap`: at most this many;
        `timing`: its first chunk's hops are stamped there (the context's first audio)."""
        synthesis, options = build_request(body.model_copy(update={"max_new_tokens": None}), info, voice_choice, voice,
                                           self._args, request_id, live=True, idle_timeout_s=idle_timeout_s)
        fits = synthesis.max_frames
        if frame_cap is not None:
            synthesis = dataclasses.replace(synthesis, max_frames=min(fits, frame_cap))
        return synthesis, fits, self._pipeline(info, synthesis, options, timing, live=True)

    def _calls(self, model: str, live: bool) -> TalkerCalls:
        """This replica's batched calls of one kind to one model's Talker (deployments/ingress/talker_calls.py)."""
        calls = self._talker_calls.get((model, live))
        if calls is None:
            config = next(m for m in self._args.models if m.name == model)
            talker = stage_handle(self._router.handle(model), self._limits.stage_transport)
            calls = self._talker_calls[(model, live)] = TalkerCalls(
                talker, self._mailbox.handle, C.TALKER_CALL_MAX_BATCH, C.TALKER_CALL_ADMISSION_WAIT_S,
                max_answer_bytes(self._limits.stage_transport), live=live,
                close_box=None if live else self._mailbox.close,  # a live context closes its own box
                # requests refused by full replicas wait to go again as Serve queues one-request calls
                max_retrying=config.max_queued_requests,
                retry_after_s=C.TALKER_CALL_RETRY_AFTER_S)
        return calls

    def _pipeline(self, info: ModelInfo, synthesis: SynthesisRequest, options: GenerateOptions,
                  timing: FirstAudioTiming | None = None, live: bool = False) -> AsyncIterator[DecodedChunk]:
        return stream_audio(self._calls(info.name, live), self._decoder, synthesis, options,
                            self._args.streaming.max_pending_decodes, timing)

    async def _start_speech(self, body: SpeechRequest, info: ModelInfo, voice_choice: VoiceChoice, request_id: str,
                            timing: FirstAudioTiming | None, piece_timeout_s: float,
                            priority: Priority = Priority.REALTIME, timed: bool = False) -> StartedSpeech:
        """A speech request started (nothing runs until its first chunk is awaited). An input longer than one Talker
        request runs as several, one voice prompt for all (deployments/ingress/long_form.py); `timed` (timestamps):
        none longer than the aligner times."""
        voice = await self._voices.prompt(body, info, voice_choice)
        max_frames = await self._aligner_max_frames() if timed else None
        planner = PiecePlanner(body, info, voice_choice, voice, self._args, request_id, priority, max_frames)
        pieces = None if planner.fits_one() else await asyncio.to_thread(planner.pieces)
        if pieces is None:
            synthesis, options = build_request(body, info, voice_choice, voice, self._args, request_id,
                                               priority=priority)
            return StartedSpeech(input_tokens(synthesis), self._pipeline(info, synthesis, options, timing=timing),
                                 client_capped=client_capped(body, synthesis, info), texts={request_id: body.input})
        cut_pieces: list[int] = []

        def start_piece(piece: PlannedPiece) -> AsyncIterator[DecodedChunk]:
            return self._pipeline(info, piece.request, piece.options, timing=timing if piece.index == 0 else None)

        def on_cut(piece: PlannedPiece, frames: int) -> None:
            cut_pieces.append(piece.index)
            self._outcomes.frame_cap_cut(info.name, f"piece {piece.index + 1} of {len(pieces)} ({request_id})",
                                         frames)

        return StartedSpeech(sum(input_tokens(p.request) for p in pieces),
                             long_form_chunks(pieces, start_piece, piece_timeout_s, on_cut), pieces=len(pieces),
                             cut_pieces=cut_pieces, texts={p.request.request_id: p.text for p in pieces})

    # ------------------------------------------------------------------ timestamps
    async def check_timestamps(self, body: SpeechRequest) -> None:
        """A 400 naming `timestamps` when the request asks for them and the server cannot time it."""
        if body.timestamps is not None:
            if self.aligner is None:
                raise no_aligner()
            check_language(body.language)

    def timestamps(self, body: SpeechRequest, texts: dict[str, str] | Callable[[str], str]
                   ) -> ResponseTimestamps | None:
        """The timestamps of a response whose Talker requests speak `texts` (by request id), if it asks for them."""
        if body.timestamps is None:
            return None
        return ResponseTimestamps(self._align, texts, body.timestamps, body.language, body.speed)

    def _align(self, request: AlignRequest) -> Awaitable[list[Word]]:
        return self.aligner.align.remote(request)

    async def _aligner_info(self) -> AlignerInfo:
        """The Aligner's limits (asked once; a 400 naming `timestamps` when the config has no aligner)."""
        if self.aligner is None:
            raise no_aligner()
        if self._aligner is None:
            async with asyncio.timeout(self._limits.request_timeout_s):
                self._aligner = await self.aligner.info.remote()
        return self._aligner

    async def _aligner_max_frames(self) -> int:
        """Frames of the longest audio the aligner times (a request with timestamps is split to fit it)."""
        return max(1, int((await self._aligner_info()).max_seconds / FRAME_SECONDS))

    # ------------------------------------------------------------------ batch jobs
    async def submit_batch(self, request: Request):
        return await self._batches.submit(request, caller(request))

    async def batch_status(self, batch_id: str):
        return await self._batches.status(batch_id)

    async def batch_item(self, batch_id: str, index: int):
        return await self._batches.item(batch_id, index)

    async def cancel_batch(self, batch_id: str):
        return await self._batches.cancel(batch_id)

    async def _check_batch_item(self, body: SpeechRequest, key: ApiKey | None) -> None:
        """What `/v1/audio/speech` checks before it generates (raises its APIError), for one item of a job; an
        uploaded voice only if `key` may use it."""
        check_limits(body, self._limits)
        info, voice_choice = await self.route(body, key)
        check_request(body, info, self._args)
        voice = await self._voices.prompt(body, info, voice_choice)
        planner = PiecePlanner(body, info, voice_choice, voice, self._args, "batch-check", Priority.BATCH)
        if planner.fits_one() or await asyncio.to_thread(planner.pieces) is None:  # a long input: every piece built
            build_request(body, info, voice_choice, voice, self._args, "batch-check")

    async def _batch_item_chunks(self, body: SpeechRequest, request_id: str) -> AsyncIterator[DecodedChunk]:
        """A batch item started as a low-priority Talker request (stages/talker/scheduler.py)."""
        check_limits(body, self._limits)
        info, voice_choice = await self.route(body)
        check_request(body, info, self._args)
        started = await self._start_speech(body, info, voice_choice, request_id, None, self._limits.request_timeout_s,
                                           Priority.BATCH)
        return started.chunks

    def __del__(self):
        """Serve's graceful stop: this replica's batch items go back to the queue for the others."""
        worker = getattr(self, "_batch_worker", None)
        if worker is not None:
            worker.close()

    # ------------------------------------------------------------------ live text (WebSocket)
    async def speech_stream(self, websocket: WebSocket):
        await LiveSession(websocket, self, self._mailbox, self._outcomes, self._work, self._sockets,
                          LiveAuth(self._auth, self._key_limits)).run()

    async def websocket_stats(self) -> dict:
        """This replica's open WebSockets (and client addresses holding some), through a deployment handle."""
        return self._sockets.stats()

    async def replica_stats(self) -> dict:
        """Which replica answered and its event loop's lag (deployments/loop_lag.py), through a deployment handle
        (`bench/replica_stats.py`)."""
        return {"replica": this_replica(), "event_loop_lag": self._loop_lag.snapshot()}

    # ------------------------------------------------------------------ models, voices, health
    async def models(self):
        return self._router.describe()

    async def model(self, model_id: str):
        return self._router.describe_one(model_id)

    async def list_voices(self, request: Request):
        return await self._voices.listing(caller(request))

    async def upload_voice(self, request: Request):
        key = caller(request)
        try:
            admission = await self._key_limits.admit(key, stream=False)  # counts in the key's requests per minute
        except APIError as exc:
            return self._outcomes.error(exc).response()
        admission.release()
        return await self._voices.upload(request, key)

    async def delete_voice(self, name: str, request: Request):
        return await self._voices.delete(name, caller(request))

    async def health(self):
        return routing.health()

    async def ready(self):
        """200 only when every Talker, Code2Wav and (where configured) the Aligner has a warmed-up replica and
        every model info is loaded."""
        return await routing.readiness(self._router, self._code2wav, self.aligner)


@dataclass
class StartedSpeech:
    """A started speech request: its usage of input, its decoded chunks, and how it may end (speech.SpeechJob)."""

    usage_in: int
    chunks: AsyncIterator[DecodedChunk]
    client_capped: bool = True
    pieces: int = 1
    cut_pieces: list[int] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)  # each Talker request's text, by its request id


def input_tokens(synthesis: SynthesisRequest) -> int:
    """A request's usage of input: its text and instruction tokens."""
    return len(synthesis.prompt.text_ids) + len(synthesis.prompt.instruct_ids or ())


def _app_name() -> str:
    """The Serve application this replica serves (the per-key counters are one actor per app)."""
    from ray import serve

    try:
        return serve.get_replica_context().app_name
    except Exception:  # outside a replica (unit tests of the class)
        return "default"
