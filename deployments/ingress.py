"""TTSIngress: the OpenAI-compatible HTTP API (FastAPI through `@serve.ingress`), CPU only.

It validates and tokenizes requests (with the tokenizer each Talker sends once), resolves voices,
routes by `model` to that checkpoint's Talker deployment, pipelines Code2Wav decodes of the Talker's
chunks (`deployments.pipeline`) and writes the audio: one body, raw chunked bytes, or SSE events.
"""

# no `from __future__ import annotations`: FastAPI resolves the route annotations (the class is pickled by value)

import asyncio
import base64
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import constants as C
from deployments import http_guard, openapi
from deployments.audio_formats import MEDIA_TYPES
from deployments.config import TTSServingArgs
from deployments.decode_batcher import DecodeBatcher
from deployments.errors import APIError, StreamAborted, bad_request, plain, shown, to_api_error, unwrap
from deployments.http_guard import BodyGuard, BodyLimits, OpenWork
from deployments.metrics import IngressMetrics
from deployments.pipeline import stream_audio
from deployments.planning import (
    VoiceChoice,
    build_request,
    check_limits,
    check_request,
    choose_voice,
    infer_model,
    resolve_model_name,
)
from deployments.playback import PlaybackClock
from deployments.protocol import DecodedChunk, ModelInfo
from deployments.ref_audio import load_ref_audio, probe_audio, read_voice_upload
from deployments.schemas import SpeechRequest
from deployments.stream_encoders import encode, open_stream_encoder
from deployments.transport import max_answer_bytes, stage_handle
from deployments.voices import VOICE_NAME_PATTERN, VoiceStore
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME, TaskType, VoiceClonePrompt

logger = logging.getLogger("ray.serve")

app = FastAPI(title="Qwen3-TTS on Ray Serve", version="0.1.0")
# bodies are read whole, within a size limit and a deadline, before any route runs (deployments/http_guard.py)
app.add_middleware(BodyGuard)
openapi.install(app)  # /openapi.json as the server answers (deployments/openapi.py)


@app.exception_handler(APIError)
async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@app.exception_handler(RequestValidationError)
async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    if first.get("type") == "json_invalid":  # loc holds the character offset, not a field
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                           code="invalid_json").response()
    return bad_request(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", ".".join(loc) or None).response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None).response()


# helpers used by TTSIngress's methods must be defined before it: @serve.ingress pickles the class by value
async def _create_voice(handle: DeploymentHandle, audio: bytes, ref_text: str | None, x_vector_only: bool,
                        param: str) -> VoiceClonePrompt:
    """The Base Talker computes the clone prompt; audio it cannot use (ValueError) is the client's fault."""
    try:
        return await handle.create_voice.remote(audio, ref_text, x_vector_only)
    except Exception as exc:  # noqa: BLE001
        inner = unwrap(exc)
        if isinstance(inner, ValueError):
            raise bad_request(f"{param}: {plain(inner)}", param, code="invalid_audio") from None
        raise


def _ignore_failure(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a failed prefetch is retried by the next request


@dataclass
class _Job:
    """One accepted speech request: its decoded-chunk pipeline (first chunk already in hand) and bookkeeping."""

    body: SpeechRequest
    model: str
    chunks: AsyncIterator[DecodedChunk]
    first: DecodedChunk | None
    deadline: float  # event-loop time
    started: float  # perf_counter at arrival
    usage_in: int  # prompt text (+ instruction) tokens


class _ModelRoute:
    """One served model: its Talker handle and, once fetched, its ModelInfo (shared by concurrent requests)."""

    def __init__(self, name: str, handle: DeploymentHandle):
        self.name, self.handle = name, handle
        self._info: ModelInfo | None = None
        self._fetch: asyncio.Future | None = None

    async def info(self) -> ModelInfo:
        if self._info is None:
            if self._fetch is None or (self._fetch.done() and self._fetch.exception() is not None):
                self._fetch = asyncio.ensure_future(self.handle.info.remote())
            self._info = await asyncio.shield(self._fetch)  # one fetch even if a waiting request is cancelled
        return self._info


@serve.ingress(app)
class TTSIngress:
    async def __init__(self, talkers: dict[str, DeploymentHandle], code2wav: DeploymentHandle, args: TTSServingArgs):
        self._args = args
        self._limits = args.ingress
        self._routes = {name: _ModelRoute(name, handle) for name, handle in talkers.items()}
        self._names = {n.lower(): m.name for m in args.models for n in (m.name, *m.aliases)}
        self._code2wav = code2wav
        transport = args.ingress.stage_transport
        self._decoder = DecodeBatcher(stage_handle(code2wav, transport), args.ingress.decode_batch.max_chunks,
                                      args.ingress.decode_batch.max_calls_in_flight, max_answer_bytes(transport))
        self._voices = VoiceStore(self._limits.voices_path)
        self._inline_voices: OrderedDict[str, VoiceClonePrompt] = OrderedDict()
        self._metrics = IngressMetrics()
        self._open_streams: dict[str, int] = dict.fromkeys(self._routes, 0)
        http_guard.configure(BodyLimits(self._limits.max_request_bytes, self._limits.body_read_timeout_s))
        self._work = OpenWork(self._limits.max_open_requests, self._limits.backpressure.retry_after_s,
                              self._limits.backpressure.status_code)
        for route in self._routes.values():  # start fetching model infos now; requests await them
            asyncio.ensure_future(route.info()).add_done_callback(_ignore_failure)

    # ------------------------------------------------------------------ speech
    @app.post("/v1/audio/speech")
    async def speech(self, body: SpeechRequest):
        try:
            self._work.acquire()  # admission of the costly part (deployments/http_guard.py)
        except APIError as exc:
            return self._fail(exc, "-", body.streaming)
        try:
            return await self._speech(body)
        finally:
            self._work.release()  # a stream holds its own count while it is sent

    async def _speech(self, body: SpeechRequest) -> Response:
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(body.timeout_s or self._limits.request_timeout_s, self._limits.request_timeout_s)
        request_id = f"speech-{uuid.uuid4().hex}"
        model = "-"  # metric tag: a served name only (never a client-chosen string)
        chunks: AsyncIterator[DecodedChunk] | None = None
        try:
            check_limits(body, self._limits)
            # validation first, then the client's deadline: a tiny `timeout_s` must not hide a 400. Routing
            # waits only for a model's info (fetched once per replica), bounded by the server's deadline.
            async with asyncio.timeout(self._limits.request_timeout_s):
                info, voice_choice = await self._route(body)
            model = info.name
            check_request(body, info, self._args)
            async with asyncio.timeout_at(deadline):
                voice = await self._voice_prompt(body, info, voice_choice)
                synthesis, options = build_request(body, info, voice_choice, voice, self._args, request_id)
                chunks = stream_audio(self._routes[info.name].handle, self._decoder, synthesis, options,
                                      self._args.streaming.max_pending_decodes, self._limits.stage_transport)
                first = await anext(chunks, None)
        except BaseException as exc:  # noqa: BLE001 - every failure before the first audio is one JSON error
            if chunks is not None:
                await chunks.aclose()
            if isinstance(exc, asyncio.CancelledError):
                self._count(model, "cancelled", body.streaming)
                raise
            return self._fail(exc, model, body.streaming)
        job = _Job(body, model, chunks, first, deadline, started,
                   usage_in=len(synthesis.prompt.text_ids) + len(synthesis.prompt.instruct_ids or ()))
        headers: dict[str, str] = {}  # Serve's proxy adds X-Request-Id (the client's own, or a new one)
        if body.streaming:
            return StreamingResponse(
                self._stream(job),
                media_type="text/event-stream" if body.stream_format == "sse" else MEDIA_TYPES[body.response_format],
                headers=headers,
            )
        return await self._whole(job, headers)

    async def _route(self, body: SpeechRequest) -> tuple[ModelInfo, VoiceChoice]:
        if body.model:
            info = await self._routes[resolve_model_name(body.model, self._names)].info()
        else:
            infos = await asyncio.gather(*(r.info() for r in self._routes.values()))
            by_name = {i.name: i for i in infos}
            info = by_name[infer_model(body, by_name, self._find_voice)]
        return info, choose_voice(body, info, self._find_voice)

    async def _voice_prompt(self, body: SpeechRequest, info: ModelInfo, choice: VoiceChoice) -> VoiceClonePrompt | None:
        handle = self._routes[info.name].handle
        if choice.inline:
            audio, _mime = await load_ref_audio(body.ref_audio, self._limits)
            probe_audio(audio, self._limits.max_ref_audio_seconds)
            ref_text = (body.ref_text or "").strip() or None
            key = hashlib.sha256(audio).hexdigest() + json.dumps([ref_text, body.x_vector_only_mode, info.fingerprint])
            prompt = self._inline_voices.get(key)
            if prompt is None:
                prompt = await _create_voice(handle, audio, ref_text, body.x_vector_only_mode, "ref_audio")
                self._inline_voices[key] = prompt
                while len(self._inline_voices) > C.INLINE_VOICE_CACHE_SIZE:
                    self._inline_voices.popitem(last=False)
            self._inline_voices.move_to_end(key)
            return prompt
        if choice.uploaded is not None:
            record = choice.uploaded
            prompt = await asyncio.to_thread(self._voices.prompt, record, info.fingerprint)
            if prompt is None:  # a model added after the upload: compute once, keep it
                audio = await asyncio.to_thread(self._voices.audio, record)
                prompt = await _create_voice(handle, audio, record.ref_text, record.x_vector_only_mode, "voice")
                await asyncio.to_thread(self._voices.put_prompt, record, info.fingerprint, prompt)
            return prompt
        return None

    async def _whole(self, job: _Job, headers: dict[str, str]) -> Response:
        pieces, finish = [], None
        try:
            async with asyncio.timeout_at(job.deadline):
                chunk = job.first
                while chunk is not None:
                    pieces.append(chunk.pcm)
                    finish = chunk.finish_reason or finish
                    chunk = await anext(job.chunks, None)
        except BaseException as exc:  # noqa: BLE001
            await job.chunks.aclose()
            if isinstance(exc, asyncio.CancelledError):
                self._count(job.model, "cancelled", False)
                raise
            return self._fail(exc, job.model, False)
        pcm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int16)
        frames = pcm.size // SAMPLES_PER_FRAME
        data = await asyncio.to_thread(encode, pcm, job.body.response_format, speed=job.body.speed)
        self._finish(job, False, frames, time_to_first=time.perf_counter() - job.started)
        headers.update({"X-Usage-Input-Tokens": str(job.usage_in), "X-Usage-Output-Tokens": str(frames),
                        "X-Audio-Duration-S": f"{round(pcm.size / job.body.speed) / SAMPLE_RATE:.3f}",
                        "X-Finish-Reason": finish.value if finish else "unknown"})
        return Response(content=data, media_type=MEDIA_TYPES[job.body.response_format], headers=headers)

    async def _stream(self, job: _Job) -> AsyncIterator[bytes]:
        sse, model = job.body.stream_format == "sse", job.model
        frames, status, finish, audio_sent = 0, "ok", None, False
        playback = PlaybackClock()
        self._work.acquire(check=False)
        self._open_streams[model] += 1
        self._metrics.open_streams.set(self._open_streams[model], tags={"model": model})

        def event(kind: str, **fields) -> bytes:
            return f"data: {json.dumps({'type': f'speech.audio.{kind}', **fields})}\n\n".encode()

        try:
            encoder = open_stream_encoder(job.body.response_format, speed=job.body.speed)
            cheap = job.body.response_format in ("pcm", "wav") and job.body.speed == 1.0

            async def encoded(step, *args) -> bytes:  # FFmpeg's work leaves the event loop; pcm/wav cost nothing
                return step(*args) if cheap else await asyncio.to_thread(step, *args)

            chunk, unsent_s = job.first, 0.0
            while True:
                if chunk is not None:
                    frames += chunk.pcm.size // SAMPLES_PER_FRAME
                    finish = chunk.finish_reason or finish
                    unsent_s += chunk.pcm.size / SAMPLE_RATE / job.body.speed
                    data = await encoded(encoder.push, chunk.pcm)
                else:
                    data = await encoded(encoder.finish)
                if data:  # a stream may end with an empty final chunk; a codec may hold a short chunk back
                    playback.sent(unsent_s)
                    unsent_s = 0.0
                    yield event("delta", audio=base64.b64encode(data).decode()) if sse else data
                    if not audio_sent:
                        audio_sent = True
                        self._metrics.time_to_first_audio_ms.observe(
                            (time.perf_counter() - job.started) * 1000, tags={"model": model, "stream": "true"})
                if chunk is None:
                    break
                async with asyncio.timeout_at(job.deadline):
                    chunk = await anext(job.chunks, None)
            if sse:
                usage = {"input_tokens": job.usage_in, "output_tokens": frames, "total_tokens": job.usage_in + frames}
                yield event("done", usage=usage, finish_reason=finish.value if finish else "unknown")
        except asyncio.CancelledError:
            status = "cancelled"  # the client went away: closing `chunks` below aborts the Talker
            raise
        except BaseException as exc:  # noqa: BLE001 - mid-stream: the status line is sent, end the stream
            error = to_api_error(exc)
            status = "timeout" if error.status == 504 else "error"
            logger.warning(f"{model}: stream failed after {frames} frames: {error.message}")
            if sse:
                yield event("error", **error.body())
            else:
                # raw bytes can only say "failed" through their framing: the response ends without its
                # terminating chunk, so clients see an incomplete read rather than a short clip that looks whole
                raise StreamAborted(error.message) from None
        finally:
            await job.chunks.aclose()
            self._work.release()
            self._open_streams[model] -= 1
            self._metrics.open_streams.set(self._open_streams[model], tags={"model": model})
            if playback.started is not None and playback.min_lead_s != float("inf"):
                self._metrics.client_buffer_lead_s.observe(max(playback.min_lead_s, 0.0), tags={"model": model})
            if playback.underruns:
                self._metrics.client_underruns.inc(playback.underruns, tags={"model": model})
                self._metrics.client_underrun_seconds.inc(playback.underrun_s, tags={"model": model})
            if status == "ok":
                self._finish(job, True, frames)
            else:
                self._count(model, status, True)

    # ------------------------------------------------------------------ models, voices, health
    @app.get("/v1/models")
    async def models(self):
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": m.name, "object": "model", "created": created, "owned_by": "qwen3-tts-serve", "aliases": m.aliases,
             **(route._info.describe() if (route := self._routes[m.name])._info is not None else {})}
            for m in self._args.models
        ]}

    @app.get("/v1/audio/voices")
    async def list_voices(self):
        infos = await self._infos()
        uploaded = await asyncio.to_thread(self._voices.list)
        voices_of = {TaskType.VOICE_DESIGN: [C.DEFAULT_VOICE_NAME], TaskType.BASE: [r.name for r in uploaded]}
        per_model = {i.name: {"task_type": i.task.value, "voices": voices_of.get(i.task, i.speakers)} for i in infos}
        presets = sorted({s for i in infos for s in i.speakers})
        return {"voices": presets, "uploaded_voices": [r.public() for r in uploaded], "models": per_model}

    @app.post("/v1/audio/voices")
    async def upload_voice(self, request: Request):
        try:
            with self._work.admit():
                return await self._upload_voice(request)
        except Exception as exc:  # noqa: BLE001 - a full Talker is 429 JSON + Retry-After, as for speech
            return self._error(exc).response()

    async def _upload_voice(self, request: Request):
        async with asyncio.timeout(self._limits.request_timeout_s):
            name, audio, mime, ref_text, x_vector_only = await read_voice_upload(request, self._limits)
            if ref_text is not None and len(ref_text) > self._limits.max_ref_text_chars:
                raise bad_request(f"ref_text is {len(ref_text)} characters; the limit is "
                                  f"{self._limits.max_ref_text_chars}", "ref_text", code="input_too_long")
            if not VOICE_NAME_PATTERN.match(name):
                raise bad_request(f"voice name {shown(name)} must match {VOICE_NAME_PATTERN.pattern}", "name")
            infos = await self._infos()
            if name.lower() == C.DEFAULT_VOICE_NAME or any(name.lower() in i.speakers for i in infos):
                raise bad_request(f"voice name {shown(name)} is taken by a preset voice", "name", code="name_taken")
            existing = await asyncio.to_thread(self._voices.list)
            if name not in {r.name for r in existing} and len(existing) >= self._limits.max_uploaded_voices:
                raise bad_request(f"there are already {len(existing)} uploaded voices (the limit)", "name",
                                  code="too_many_voices")
            probe_audio(audio, self._limits.max_ref_audio_seconds, "audio_sample")
            base = [i for i in infos if i.task is TaskType.BASE]
            if not base:
                raise bad_request(f"uploaded voices are for Base (voice clone) models; none is served "
                                  f"(served: {[i.name for i in infos]})", code="unsupported_task")
            x_vector_only = x_vector_only or ref_text is None
            prompts = await asyncio.gather(*(
                _create_voice(self._routes[i.name].handle, audio, ref_text, x_vector_only, "audio_sample")
                for i in base))
            record = await asyncio.to_thread(
                self._voices.save, name, audio, ref_text, x_vector_only, mime,
                {i.fingerprint: p for i, p in zip(base, prompts, strict=True)})
        logger.info(f"voice {name!r} uploaded ({len(audio)} bytes, prompts for {[i.name for i in base]})")
        return {"success": True, "voice": record.public()}

    @app.delete("/v1/audio/voices/{name}")
    async def delete_voice(self, name: str):
        record = await asyncio.to_thread(self._find_voice, name)  # case-insensitive, as when it is used
        if record is None or not await asyncio.to_thread(self._voices.delete, record.name):
            raise APIError(404, f"no uploaded voice named {shown(name)}", param="name", code="voice_not_found")
        return {"success": True, "name": record.name}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self):
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self):
        """200 only when every Talker and Code2Wav has a warmed-up replica and every model info is loaded."""
        probes = {name: r.handle.ready.remote() for name, r in self._routes.items()}
        probes[C.CODE2WAV_DEPLOYMENT_NAME] = self._code2wav.ready.remote()
        state = {}
        for name, response in probes.items():
            try:
                async with asyncio.timeout(C.READY_PROBE_TIMEOUT_S):
                    state[name] = bool(await response)
            except Exception:  # noqa: BLE001 - not started, still warming up, or failing: not ready
                response.cancel()
                state[name] = False
        for name, route in self._routes.items():
            if state[name] and route._info is None:
                try:
                    async with asyncio.timeout(C.READY_PROBE_TIMEOUT_S):
                        await route.info()
                except Exception:  # noqa: BLE001
                    state[name] = False
        ready = all(state.values())
        return JSONResponse({"ready": ready, "deployments": state}, status_code=200 if ready else 503)

    # ------------------------------------------------------------------ helpers
    async def _infos(self) -> list[ModelInfo]:
        try:
            async with asyncio.timeout(self._limits.request_timeout_s):
                return list(await asyncio.gather(*(r.info() for r in self._routes.values())))
        except Exception as exc:  # noqa: BLE001
            raise to_api_error(exc) from None

    def _find_voice(self, name: str):
        return self._voices.find(name) if name else None

    def _error(self, exc: BaseException) -> APIError:
        """The client's answer; a client error is one log line (never a traceback), ours is an ERROR."""
        limits = self._limits.backpressure
        error = to_api_error(exc, overload_status=limits.status_code, retry_after_s=limits.retry_after_s)
        if error.status >= 500 and error.status not in (503, 504):
            logger.error(f"{error.status} {error.code}: {error.message}")
        else:
            logger.info(f"{error.status} {error.code}: {error.message[:200]}")
        return error

    def _fail(self, exc: BaseException, model: str, stream: bool) -> JSONResponse:
        error = self._error(exc)
        status = {400: "bad_request", 404: "not_found", 413: "bad_request", 429: "rejected", 503: "rejected",
                  504: "timeout"}.get(error.status, "error" if error.status >= 500 else "bad_request")
        self._count(model, status, stream)
        return error.response()

    def _count(self, model: str, status: str, stream: bool) -> None:
        self._metrics.requests.inc(tags={"model": model, "status": status, "stream": str(stream).lower()})

    def _finish(self, job: _Job, stream: bool, frames: int, time_to_first: float | None = None) -> None:
        model, elapsed = job.model, time.perf_counter() - job.started
        audio_s = frames * SAMPLES_PER_FRAME / SAMPLE_RATE
        self._count(model, "ok", stream)
        self._metrics.audio_seconds.inc(audio_s, tags={"model": model})
        if audio_s > 0:
            self._metrics.real_time_factor.observe(elapsed / audio_s, tags={"model": model})
        if time_to_first is not None:
            self._metrics.time_to_first_audio_ms.observe(time_to_first * 1000, tags={"model": model, "stream": "false"})
