"""`/v1/audio/speech/stream`: a WebSocket for text that arrives as it is written (docs/websocket.md).

One `LiveSession` per connection. Each `open` starts a context: live requests on its model's Talker
(batched with the replica's other live requests into `Talker.generate_live_many` calls: deployments/ingress/
live_calls.py), one after another when its text outgrows one (deployments/ingress/live_pieces.py), whose
text the session puts in this ingress replica's `TextMailbox` as the client sends it (in order: a message's put is
awaited before the next message is read), and whose audio a task of its own encodes into one stream and sends as
binary frames tagged with the context id. A bad message is answered with
an error message (`"final": false`) and changes nothing, whatever its size or depth; a context that fails ends
with an error message (`"final": true`); the socket and the other contexts go on. Every context ends with
`done` or a final error. When the client leaves, every context it had open is cancelled (its Talker request
aborted, its slot freed). A socket without an open context for `ingress.websocket_idle_timeout_s` is closed,
and the replica's sockets are capped (deployments/ingress/socket_limits.py).

Binary frames: `audio_frame` (deployments/ingress/schemas.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import WebSocket
from opentelemetry import trace
from pydantic import ValidationError
from ray.exceptions import TaskCancelledError
from starlette.websockets import WebSocketDisconnect

from deployments import first_audio_timing
from deployments.audio.encoders import AsyncStreamEncoder
from deployments.errors import APIError, bad_request
from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress.api_keys import SPEECH, ApiKey
from deployments.ingress.auth import Auth, websocket_token
from deployments.ingress.http_guard import OpenWork
from deployments.ingress.live_pieces import LivePieces, MailboxPieces
from deployments.ingress.outcomes import Outcomes, PlaybackClock
from deployments.ingress.rate_limits import Admission, KeyLimits
from deployments.ingress.request_builder import check_limits, check_live_text, check_request
from deployments.ingress.request_log import RequestRecord, key_hash
from deployments.ingress.schemas import (
    LIVE_MESSAGES,
    LiveAppend,
    LiveCancel,
    LiveEnd,
    LiveFlush,
    LiveOpen,
    audio_frame,
    auth_message_key,
    context_id_of,
    invalid_message,
)
from deployments.ingress.socket_limits import CLOSE_NORMAL, CLOSE_TRY_AGAIN_LATER, SocketLimits
from deployments.ingress.speech import usage
from deployments.ingress.timestamps import ResponseTimestamps
from deployments.messages import ModelInfo
from deployments.text_mailbox import MailboxWriter
from stages.contract import SAMPLE_RATE


class LiveIngress(Protocol):
    """What a session needs of the ingress (`deployments.ingress.server.TTSIngress`)."""

    @property
    def args(self) -> Any: ...

    async def route(self, body, key=None) -> tuple[Any, Any]: ...

    async def voice_prompt(self, body, info, choice): ...

    async def check_timestamps(self, body) -> None: ...

    def timestamps(self, body, texts) -> ResponseTimestamps | None: ...

    def start_live(self, body, info, choice, voice, request_id: str, idle_timeout_s: float | None = None,
                   frame_cap: int | None = None) -> tuple[Any, int, Any]: ...

logger = logging.getLogger("ray.serve")



def _note_first_text(ctx: _Context) -> None:
    """The context's first text: its first audio is timed from here (both clocks: the metric's and the stages')."""
    if ctx.first_text_at is None:
        ctx.first_text_at = time.perf_counter()
        ctx.timing.arrived = first_audio_timing.now()


@dataclass
class _Context:
    id: str
    request_id: str
    model: str
    body: LiveOpen
    info: ModelInfo  # its model: the tokenizer (usage counts the text's tokens at the end)
    pieces: LivePieces
    # its first audio's stages from its first text (deployments/first_audio_timing.py), sent with its `done`
    timing: FirstAudioTiming
    text: list[str] = field(default_factory=list)
    chars: int = 0
    ended: bool = False  # `end` received: no more text
    cancelled: bool = False  # `cancel` received
    first_text_at: float | None = None  # perf_counter of its first text: first audio is timed from here
    task: asyncio.Task | None = None
    failure: APIError | None = None  # why the ingress ended it (its task cancelled): its final error
    record: RequestRecord | None = None  # its log line (deployments/ingress/request_log.py)
    admission: Admission | None = None  # its slot under its key's limits
    timestamps: ResponseTimestamps | None = None  # its word times, when its `open` asked for them
    open_ms: float = 0.0  # its `open` message's handling, during which this socket's next message waits unread


class LiveSession:
    """One WebSocket connection and the contexts open on it."""

    def __init__(self, websocket: WebSocket, ingress: LiveIngress, mailbox: MailboxWriter, outcomes: Outcomes,
                 work: OpenWork, sockets: SocketLimits, auth: LiveAuth | None = None):
        """`mailbox`: the ingress replica's `MailboxWriter` (deployments/text_mailbox.py);
        `sockets`: the replica's WebSocket counts; `auth`: API keys and their limits (None: no keys)."""
        self._ws, self._ingress, self._mailbox = websocket, ingress, mailbox
        self._auth = auth
        self._key: ApiKey | None = None
        self._outcomes, self._work, self._sockets = outcomes, work, sockets
        self._limits = ingress.args.ingress
        self._contexts: dict[str, _Context] = {}
        self._send_lock = asyncio.Lock()  # whole messages, one at a time, from the contexts' tasks
        self._closing = False
        self._idle_since = time.monotonic()  # when its last context ended (or it connected)

    async def run(self) -> None:
        client = self._ws.client.host if self._ws.client else "-"
        refused = self._sockets.admit(client)
        if refused is not None:  # accepted to say why: a refused handshake tells the client nothing
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self._ws.accept()
                await self._error(None, APIError(503, f"{refused}; try again later", code="too_many_connections"),
                                  final=True)
            await self._close(CLOSE_TRY_AGAIN_LATER, "too many connections, try again later")
            return
        receive: asyncio.Task | None = None
        try:
            await self._ws.accept()
            if not await self._authenticate():
                return
            while True:
                # one receive in flight across idle checks: cancelling a receive could lose its message
                receive = receive or asyncio.ensure_future(self._ws.receive())
                idle_s = self._limits.websocket_idle_timeout_s
                left = idle_s if self._contexts else self._idle_since + idle_s - time.monotonic()
                if left <= 0:
                    await self._close(CLOSE_NORMAL, f"no open context for {idle_s:g} s")
                    break
                done, _ = await asyncio.wait({receive}, timeout=left)
                if not done:
                    continue
                message, receive = receive.result(), None
                if message["type"] == "websocket.disconnect":
                    break
                if message.get("text") is None:
                    await self._error(None, bad_request("messages to the server are JSON text; binary messages "
                                                        "are not accepted", code="invalid_message"))
                    continue
                try:
                    await self._handle(message["text"])
                except Exception:  # a bug must not end the socket and its other contexts
                    logger.exception("a WebSocket message failed")
                    await self._error(None, APIError(500, "the server failed to handle a message",
                                                     code="internal_error"))
        except (WebSocketDisconnect, TaskCancelledError):  # the client left (Serve's proxy cancelled the receive)
            pass
        finally:
            if receive is not None:
                receive.cancel()
            self._sockets.release(client)
            await self._close_all()

    async def _authenticate(self) -> bool:
        """The socket's key (auth.py): its handshake's, or a first message `{"type": "auth", "api_key": KEY}`.
        False (the socket told why and closed) when it has none that may speak."""
        if self._auth is None or not self._auth.auth.enabled:
            return True
        token = websocket_token(self._ws.scope)
        if token is None:
            try:
                message = await asyncio.wait_for(self._ws.receive(), self._limits.websocket_idle_timeout_s)
            except TimeoutError:
                message = {}
            if message.get("type") == "websocket.disconnect":
                return False
            token = auth_message_key(message.get("text"))
        try:
            self._key = self._auth.auth.check(token, SPEECH)
        except APIError as error:
            await self._error(None, error, final=True)
            await self._close(CLOSE_POLICY_VIOLATION, "authentication failed")
            return False
        logger.info(f"WebSocket authenticated key={self._key.label}")  # the key's hash prefix, never the key
        if token is not None and websocket_token(self._ws.scope) is None:
            await self._send_json({"type": "authenticated"})
        return True

    async def _close(self, code: int, reason: str) -> None:
        self._closing = True
        async with self._send_lock:
            with contextlib.suppress(WebSocketDisconnect, RuntimeError, OSError):
                await self._ws.close(code, reason)

    # ------------------------------------------------------------------ client messages
    async def _handle(self, raw: str) -> None:
        try:
            message = LIVE_MESSAGES.validate_json(raw)
        except ValidationError as e:
            await self._error(context_id_of(raw), invalid_message(e))
            return
        if isinstance(message, LiveOpen):
            await self._open(message)
            return
        ctx = self._contexts.get(message.context_id)
        if ctx is None:
            await self._error(message.context_id, APIError(
                404, f"no open context {message.context_id!r} (never opened, or it has ended)", param="context_id",
                code="context_not_found"))
            return
        if isinstance(message, LiveCancel):
            ctx.cancelled = True
            ctx.task.cancel()
            return
        if ctx.ended:
            await self._error(ctx.id, bad_request(f"context {ctx.id!r} has ended its text; open a new context",
                                                  "type", code="context_ended"))
            return
        text = message.text if isinstance(message, (LiveAppend, LiveEnd)) else ""
        if text:
            try:
                check_live_text(ctx.chars + len(text), self._limits)
            except APIError as error:
                await self._error(ctx.id, error)  # the text is dropped; the context goes on
                return
        if isinstance(message, LiveEnd) and not ctx.chars + len(text):  # the Talker would refuse it: it ends here
            self._end_with(ctx, bad_request("the context ended without any text", "text", code="empty_input"))
            return
        # each awaited (its mailbox puts): the next message's text is put after this one's
        if text:
            ctx.text.append(text)
            ctx.chars += len(text)
            _note_first_text(ctx)
            await ctx.pieces.append(text)
        if isinstance(message, LiveFlush):
            await ctx.pieces.flush()
        elif isinstance(message, LiveEnd):
            ctx.ended = True
            await ctx.pieces.end()

    def _end_with(self, ctx: _Context, error: APIError) -> None:
        """End a context from the ingress with its final error (logged at INFO, as the client's error)."""
        ctx.ended = True
        ctx.failure = error
        self._outcomes.error(error)
        ctx.task.cancel()

    async def _open(self, body: LiveOpen) -> None:
        request_id = f"live-{uuid.uuid4().hex}"
        record = RequestRecord(request_id, "live", len(body.input), True, voice=body.voice, request_id=request_id,
                               key_hash=key_hash(self._ws.headers.get("authorization"),
                                                 self._ws.query_params.get("api_key")))
        # the context's calls to the Talker and Code2Wav (its task inherits this) carry its span
        with trace.use_span(record.span, end_on_exit=False):
            await self._open_context(body, request_id, record)

    async def _open_context(self, body: LiveOpen, request_id: str, record: RequestRecord) -> None:
        cid = body.context_id
        if cid in self._contexts:
            await self._error(cid, bad_request(f"context {cid!r} is already open", "context_id", code="context_exists"))
            record.end("bad_request", 400)
            return
        if len(self._contexts) >= self._limits.max_contexts_per_connection:
            await self._error(cid, APIError(429, f"{self._limits.max_contexts_per_connection} contexts are already "
                                            "open on this connection", code="too_many_contexts"), final=True)
            record.end("rejected", 429)
            return
        model, pieces, admission, opening = "-", None, None, time.perf_counter()
        timing = FirstAudioTiming(arrived=0.0, live=True)  # `arrived`: set by its first text
        body = body.with_default_format(self._limits.default_response_format)
        try:
            if self._auth is not None:  # the key's limits, across replicas (deployments/ingress/rate_limits.py)
                admission = await self._auth.limits.admit(self._key, stream=True)
            self._work.acquire()  # admission, as for an HTTP request (429 when the replica is full)
        except APIError as error:
            if admission is not None:
                admission.release()
            await self._error(cid, self._outcomes.failed(error, model, True, record), final=True)
            return
        try:
            check_limits(body, self._limits, live=True)
            check_live_text(len(body.input), self._limits)
            info, voice_choice = await self._ingress.route(body, self._key)
            model = record.model = info.name
            check_request(body, info, self._ingress.args)
            await self._ingress.check_timestamps(body)
            voice = await self._ingress.voice_prompt(body, info, voice_choice)
            io = MailboxPieces(self._ingress, self._mailbox, body, info, voice_choice, voice, timing)
            pieces = LivePieces(io, request_id, info.tokenizer, info.max_text_rows, self._limits.long_form,
                                body.max_new_tokens, on_cut=lambda k, frames: self._outcomes.frame_cap_cut(
                                    info.name, f"piece {k + 1} of live context {request_id}", frames))
            await pieces.open()
        except Exception as exc:  # every failure to open is one error message
            self._work.release()
            if admission is not None:
                admission.release()
            if pieces is not None:
                await pieces.aclose()
            await self._error(cid, self._outcomes.failed(exc, model, True, record), final=True)
            return
        ctx = _Context(cid, request_id, model, body, info, pieces, timing, record=record, admission=admission,
                       timestamps=self._ingress.timestamps(body, pieces.piece_text),
                       open_ms=(time.perf_counter() - opening) * 1000)
        self._contexts[cid] = ctx
        self._outcomes.stream_opened(model)
        # `opened` once the Talker took the request (_speak): one beyond its queue gets only a final error. Text
        # sent meanwhile waits in the mailbox.
        ctx.task = asyncio.get_running_loop().create_task(self._speak(ctx))
        if body.input:
            ctx.text.append(body.input)
            ctx.chars = len(body.input)
            _note_first_text(ctx)
            await pieces.append(body.input)

    # ------------------------------------------------------------------ a context's audio
    async def _speak(self, ctx: _Context) -> None:
        status, audio_sent = "ok", False
        encoder = AsyncStreamEncoder(ctx.body.response_format, ctx.body.speed)  # one stream for all its pieces
        chunks = ctx.pieces.chunks()
        try:
            await anext(chunks)  # `Admitted`; raises if the Talker refused the request (e.g. its queue is full)
            await self._send_json({"type": "opened", "context_id": ctx.id, "model": ctx.model,
                                   "request_id": ctx.request_id})
            ts = ctx.timestamps
            async for chunk in chunks:
                if ts is not None:
                    ts.observe(chunk)
                if data := await encoder.push(chunk.pcm):
                    await self._send_bytes(audio_frame(ctx.id, data))
                    if not audio_sent and ctx.first_text_at is not None:
                        audio_sent = True
                        ctx.timing.responded = first_audio_timing.now()
                        self._outcomes.first_stream_audio(ctx.model, ctx.first_text_at)
                        ctx.record.first_audio(since=ctx.first_text_at)
                if ts is not None:
                    await self._send_timestamps(ctx, ts.ready())
            if data := await encoder.finish():
                await self._send_bytes(audio_frame(ctx.id, data))
            if ts is not None:
                ts.end()
                async with asyncio.timeout(self._limits.request_timeout_s):
                    await self._send_timestamps(ctx, await ts.rest())
            finish = ctx.pieces.finish_reason
            await self._send_json(self._done(ctx, finish.value if finish else "unknown"))
        except asyncio.CancelledError:
            status = "cancelled"
            if not (ctx.cancelled or ctx.failure) or self._closing:
                raise  # the connection is closing: nobody to tell
            if ctx.failure is not None:
                status = "error"
                await self._error(ctx.id, ctx.failure, final=True)
            else:
                await self._send_json(self._done(ctx, "cancelled"))
        except Exception as exc:  # this context failed (or was refused); the socket and the others go on
            error = self._outcomes.error(exc)
            status = "timeout" if error.status in (408, 504) else "rejected" if error.status == 429 else "error"
            await self._error(ctx.id, error, final=True)
        finally:
            await chunks.aclose()
            await ctx.pieces.aclose()  # aborts every Talker request of it that has not ended
            if ctx.timestamps is not None:
                await ctx.timestamps.aclose()
            self._work.release()
            if ctx.admission is not None:
                ctx.admission.release()
            # a fresh clock: waits for text are the client's, not gaps
            ctx.record.input_chars = ctx.chars
            self._outcomes.stream_ended(ctx.model, status, ctx.first_text_at or time.perf_counter(), ctx.pieces.frames,
                                        PlaybackClock(), ctx.record)
            self._contexts.pop(ctx.id, None)
            if not self._contexts:
                self._idle_since = time.monotonic()

    async def _send_timestamps(self, ctx: _Context, events: list[dict]) -> None:
        for event in events:
            await self._send_json({"type": "timestamps", "context_id": ctx.id, **event})

    def _done(self, ctx: _Context, finish_reason: str) -> dict:
        frames = ctx.pieces.frames
        input_tokens = len(ctx.info.tokenizer.encode("".join(ctx.text))) if ctx.text else 0
        done = {"type": "done", "context_id": ctx.id, "finish_reason": finish_reason,
                "usage": usage(input_tokens, frames),
                "audio_seconds": round(ctx.pieces.samples / SAMPLE_RATE / ctx.body.speed, 3)}
        if ctx.timing.responded is not None:
            done["first_audio_ms"] = {stage: round(ms, 2) for stage, ms in ctx.timing.stages_ms().items()}
            done["open_ms"] = round(ctx.open_ms, 2)
        return done

    async def _close_all(self) -> None:
        self._closing = True
        tasks = [ctx.task for ctx in self._contexts.values() if ctx.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._contexts.clear()  # nothing of a closed socket stays referenced

    # ------------------------------------------------------------------ sending
    async def _error(self, context_id: str | None, error: APIError, final: bool = False) -> None:
        """`final`: the context has ended (or never opened): no `done` follows."""
        await self._send_json({"type": "error", "context_id": context_id, "status": error.status, **error.body(),
                               "final": final})

    async def _send_json(self, message: dict) -> None:
        await self._send(self._ws.send_text, json.dumps(message))

    async def _send_bytes(self, data: bytes) -> None:
        await self._send(self._ws.send_bytes, data)

    async def _send(self, send, data) -> None:
        if self._closing:
            return
        async with self._send_lock:
            try:
                await send(data)
            except (WebSocketDisconnect, RuntimeError, OSError):  # the client is gone: the receive loop ends all
                self._closing = True


@dataclass(frozen=True)
class LiveAuth:
    """The ingress's API keys and per-key limits, for its WebSocket sessions."""

    auth: Auth
    limits: KeyLimits


CLOSE_POLICY_VIOLATION = 1008  # RFC 6455: the socket did not authenticate
