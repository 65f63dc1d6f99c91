"""Writing an accepted speech request's audio: one whole body, or a stream of raw bytes or SSE events.

Both writers take a `SpeechJob` whose decoded-chunk pipeline already produced its first chunk (so every
failure before audio was a JSON error), run within the request's deadline, and record the outcome.

A raw stream ends without its terminating chunk when the speech was cut (the client set no frame cap and a
Talker request reached its own without EOS) or failed: only a whole speech ends as a whole file.

The SSE events of a stream (`stream_format: sse`) are OpenAI's `speech.audio.*` events:

    data: {"type": "speech.audio.delta", "audio": <base64 of the encoded chunk>}      one per chunk
    data: {"type": "speech.audio.timestamps", "words": [...]}                        with `timestamps`, after
                                                                                     the audio they time
    data: {"type": "speech.audio.done", "usage": {...}, "finish_reason": ...}         at the end
    data: {"type": "speech.audio.error", "error": {"message": ..., ...}}             instead, on a failure
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from fastapi.responses import JSONResponse, Response, StreamingResponse

from deployments.audio.encoders import AsyncStreamEncoder, encode
from deployments.audio.formats import MEDIA_TYPES
from deployments.errors import APIError, StreamAborted, to_api_error
from deployments.ingress.http_guard import OpenWork
from deployments.ingress.outcomes import Outcomes, PlaybackClock
from deployments.ingress.request_log import RequestRecord
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.timestamps import ResponseTimestamps
from deployments.messages import DecodedChunk
from stages.contract import SAMPLE_RATE, FinishReason

logger = logging.getLogger("ray.serve")


@dataclass
class SpeechJob:
    """One accepted speech request: its decoded-chunk pipeline (first chunk already in hand) and bookkeeping."""

    body: SpeechRequest
    model: str
    chunks: AsyncIterator[DecodedChunk]
    first: DecodedChunk | None
    deadline: float  # event-loop time
    started: float  # perf_counter at arrival
    usage_in: int  # prompt text (+ instruction) tokens
    record: RequestRecord | None = None  # its log line (deployments/ingress/request_log.py)
    client_capped: bool = True  # its frame cap is the client's (deployments/ingress/long_text.client_capped)
    pieces: int = 1  # Talker requests of a long input (deployments/ingress/long_form.py)
    cut_pieces: list[int] = field(default_factory=list)  # of those, the ones cut at their frame cap (counted there)
    timestamps: ResponseTimestamps | None = None  # the client asked for `timestamps` (deployments/ingress/timestamps.py)

    def cut(self, finish: FinishReason | None) -> bool:
        """The speech stopped at a frame cap the client did not ask for: the audio is not all the text."""
        if self.pieces > 1:
            return bool(self.cut_pieces)
        return finish is FinishReason.LENGTH and not self.client_capped

    def note_cut(self, outcomes: Outcomes, frames: int) -> None:
        if self.pieces == 1:
            outcomes.frame_cap_cut(self.model, f"request {self.record.engine_request_id if self.record else ''}",
                                   frames)


async def whole_response(job: SpeechJob, outcomes: Outcomes, headers: dict[str, str]) -> Response:
    """All the audio in one body of `response_format`, usage in X-* headers; a failure is a JSON error. With
    `timestamps`, a JSON body instead: the audio file as base64 and its words (`timed_body`)."""
    pieces, finish, events, ts = [], None, [], job.timestamps
    try:
        async with asyncio.timeout_at(job.deadline):
            chunk = job.first
            while chunk is not None:
                pieces.append(chunk)
                if ts is not None:
                    ts.observe(chunk)
                finish = chunk.finish_reason or finish
                chunk = await anext(job.chunks, None)
            if ts is not None:
                ts.end()
                events = await ts.rest()
    except BaseException as exc:
        await job.chunks.aclose()
        if ts is not None:
            await ts.aclose()
        if isinstance(exc, asyncio.CancelledError):
            outcomes.count(job.model, "cancelled", False, job.record)
            raise
        return outcomes.fail(exc, job.model, False, job.record)
    pcm = np.concatenate([c.pcm for c in pieces]) if pieces else np.zeros(0, dtype=np.int16)
    frames = sum(c.codec_frames for c in pieces)
    if job.cut(finish):
        job.note_cut(outcomes, frames)
    data = await asyncio.to_thread(encode, pcm, job.body.response_format, speed=job.body.speed)
    if job.record is not None:
        job.record.first_audio()  # the whole body is its first audio
    outcomes.finish(job.model, job.started, False, frames, time_to_first=time.perf_counter() - job.started,
                    record=job.record)
    audio_s = round(pcm.size / job.body.speed) / SAMPLE_RATE
    headers.update({"X-Usage-Input-Tokens": str(job.usage_in), "X-Usage-Output-Tokens": str(frames),
                    "X-Audio-Duration-S": f"{audio_s:.3f}", "X-Finish-Reason": finish.value if finish else "unknown"})
    if ts is not None:
        return JSONResponse(timed_body(data, job, audio_s, frames, finish, events), headers=headers)
    return Response(content=data, media_type=MEDIA_TYPES[job.body.response_format], headers=headers)


def timed_body(audio: bytes, job: SpeechJob, audio_s: float, frames: int, finish: FinishReason | None,
               events: list[dict]) -> dict:
    """`stream: false` with `timestamps`: the audio file (base64) with every span's words (and characters) in one
    list each; spans the aligner could not time are listed in `timestamp_errors`."""
    body = {"audio": base64.b64encode(audio).decode(), "response_format": job.body.response_format,
            "audio_seconds": round(audio_s, 3), "words": [w for e in events for w in e["words"]]}
    if job.body.timestamps == "char":
        body["chars"] = [c for e in events for c in e["chars"]]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        body["timestamp_errors"] = errors
    return {**body, "usage": usage(job.usage_in, frames), "finish_reason": finish.value if finish else "unknown"}


# a stream is read as it comes: no cache may keep it, no proxy (nginx's X-Accel-Buffering) may hold it back
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_response(job: SpeechJob, outcomes: Outcomes, work: OpenWork, headers: dict[str, str]) -> StreamingResponse:
    """The audio as it comes: raw encoded bytes, or SSE events (`stream_format: sse`)."""
    sse_events = job.body.sse
    headers = {**headers, **STREAM_HEADERS}
    return StreamingResponse(_stream(job, outcomes, work),
                             media_type=SSE_MEDIA_TYPE if sse_events else MEDIA_TYPES[job.body.response_format],
                             headers=headers)


async def _stream(job: SpeechJob, outcomes: Outcomes, work: OpenWork) -> AsyncIterator[bytes]:
    as_sse, model, ts = job.body.sse, job.model, job.timestamps
    frames, status, finish, audio_sent, truncated = 0, "ok", None, False, False
    playback = PlaybackClock()
    work.acquire(check=False)  # the stream holds its own count while it is sent (deployments/ingress/http_guard.py)
    outcomes.stream_opened(model)
    try:
        encoder = AsyncStreamEncoder(job.body.response_format, job.body.speed)
        chunk, unsent_s = job.first, 0.0
        while True:
            if chunk is not None:
                frames += chunk.codec_frames
                finish = chunk.finish_reason or finish
                unsent_s += chunk.pcm.size / SAMPLE_RATE / job.body.speed
                if ts is not None:
                    ts.observe(chunk)
                data = await encoder.push(chunk.pcm)
            else:
                if ts is not None:
                    ts.end()
                data = await encoder.finish()
            if data:  # a stream may end with an empty final chunk; a codec may hold a short chunk back
                playback.sent(unsent_s)
                unsent_s = 0.0
                yield sse_delta(data) if as_sse else data
                if not audio_sent:
                    audio_sent = True
                    outcomes.first_stream_audio(model, job.started)
                    if job.record is not None:
                        job.record.first_audio()
            if ts is not None:  # spans aligned by now, each after its audio
                for event in ts.ready():
                    yield sse_event("timestamps", **event)
            if chunk is None:
                break
            async with asyncio.timeout_at(job.deadline):
                chunk = await anext(job.chunks, None)
        if job.cut(finish):
            job.note_cut(outcomes, frames)
        if ts is not None:
            async with asyncio.timeout_at(job.deadline):
                for event in await ts.rest():
                    yield sse_event("timestamps", **event)
        if as_sse:
            yield sse_done(job.usage_in, frames, finish)
        else:
            truncated = job.cut(finish)
    except asyncio.CancelledError:
        status = "cancelled"  # the client went away: closing `chunks` below aborts the Talker
        raise
    except BaseException as exc:  # mid-stream: the status line is sent, end the stream
        error = to_api_error(exc)
        status = "timeout" if error.status == 504 else "error"
        logger.warning(f"{model}: stream failed after {frames} frames: {error.message}")
        if as_sse:
            yield sse_error(error)
        else:
            # raw bytes can only say "failed" through their framing: the response ends without its
            # terminating chunk, so clients see an incomplete read rather than a short clip that looks whole
            raise StreamAborted(error.message) from None
    finally:
        await job.chunks.aclose()
        if ts is not None:
            await ts.aclose()
        work.release()
        outcomes.stream_ended(model, status, job.started, frames, playback, job.record)
    if truncated:  # raw bytes cannot carry a finish reason: a cut speech must not look like a whole one
        raise StreamAborted("the speech reached its frame cap without EOS; the audio sent stops there")


SSE_MEDIA_TYPE = "text/event-stream"


def sse_event(kind: str, **fields) -> bytes:
    return f"data: {json.dumps({'type': f'speech.audio.{kind}', **fields})}\n\n".encode()


def sse_delta(audio: bytes) -> bytes:
    return sse_event("delta", audio=base64.b64encode(audio).decode())


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}


def sse_done(input_tokens: int, output_tokens: int, finish: FinishReason | None) -> bytes:
    return sse_event("done", usage=usage(input_tokens, output_tokens), finish_reason=finish.value if finish else "unknown")


def sse_error(error: APIError) -> bytes:
    return sse_event("error", **error.body())
