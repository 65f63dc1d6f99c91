"""What became of each request: the client's JSON error for a failure, the ingress's metrics, its log line
(deployments/ingress/request_log.py, when the caller passes the request's record), and how a streaming client's
buffer fared.

`PlaybackClock` is the server-side estimate of a streaming client's buffer: a player that starts at the first
byte plays in real time from the moment the first audio byte is sent. Before each later send, `lead` = audio
already sent - playback time elapsed; a negative lead is an underrun (the listener heard a gap). Network time
is not included: this is the server's contribution to continuity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

from deployments.config import BackpressureSettings
from deployments.errors import APIError, to_api_error
from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress.request_log import CLIENT_CLOSED_STATUS, RequestRecord
from deployments.metrics import IngressMetrics
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME

logger = logging.getLogger("ray.serve")

# an error's HTTP status -> the `status` tag of tts_requests (others: "error" from 500 up, else "bad_request")
_STATUS_TAGS = {400: "bad_request", 404: "not_found", 408: "timeout", 413: "bad_request", 429: "rejected", 503: "rejected",
                504: "timeout"}


class RouterBackpressureLines(logging.Filter):
    """Drops the WARNING Serve's router logs when a handle call is refused for a full queue: a refused request
    is one line, Serve's access line (the metric `tts_rejections` names the limit)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING
                    and str(record.msg).startswith("Request dropped due to backpressure"))


class Outcomes:
    """Request outcomes of one ingress replica, by served model name ("-" before a model is known)."""

    def __init__(self, backpressure: BackpressureSettings, models: Iterable[str]):
        if not any(isinstance(f, RouterBackpressureLines) for f in logger.filters):
            logger.addFilter(RouterBackpressureLines())
        self.metrics = IngressMetrics()
        self._backpressure = backpressure
        self._open_streams = dict.fromkeys(models, 0)

    def error(self, exc: BaseException) -> APIError:
        """The client's answer; a client error is one log line (never a traceback), ours is an ERROR."""
        limits = self._backpressure
        error = to_api_error(exc, overload_status=limits.status_code, retry_after_s=limits.retry_after_s)
        if error.status >= 500 and error.status not in (503, 504):
            logger.error(f"{error.status} {error.code}: {error.message}")
        elif error.code == "overloaded":  # Serve's access line says 429/503 already; the metric names the limit
            logger.debug(f"{error.status} {error.code} (limit: {error.limit})")
        else:
            by = f" (limit: {error.limit})" if error.limit else ""
            logger.info(f"{error.status} {error.code}: {error.message[:200]}{by}")
        return error

    def fail(self, exc: BaseException, model: str, stream: bool, record: RequestRecord | None = None) -> JSONResponse:
        """A request that ends before its audio: counted, logged, and answered with its JSON error."""
        return self.failed(exc, model, stream, record).response()

    def failed(self, exc: BaseException, model: str, stream: bool, record: RequestRecord | None = None) -> APIError:
        """A failed request (or WebSocket context), counted and logged: -> the error its client gets."""
        error = self.error(exc)
        tag = _STATUS_TAGS.get(error.status, "error" if error.status >= 500 else "bad_request")
        self.count(model, tag, stream)
        if error.limit:
            self.metrics.rejections.inc(tags={"model": model, "limit": error.limit})
        if record is not None:
            record.end(tag, error.status)
        return error

    def count(self, model: str, status: str, stream: bool, record: RequestRecord | None = None) -> None:
        """A request's end by its `status` tag; with `record`, its log line too (a cancelled request: 499)."""
        self.metrics.requests.inc(tags={"model": model, "status": status, "stream": str(stream).lower()})
        if record is not None:
            record.end(status, CLIENT_CLOSED_STATUS if status == "cancelled" else 200)

    def finish(self, model: str, started: float, stream: bool, frames: int, time_to_first: float | None = None,
               record: RequestRecord | None = None) -> None:
        """A request whose audio was all sent; `started` is its perf_counter at arrival."""
        elapsed = time.perf_counter() - started
        audio_s = frames * SAMPLES_PER_FRAME / SAMPLE_RATE
        self.count(model, "ok", stream)
        if record is not None:
            record.end("ok", 200, audio_s)
        self.metrics.audio_seconds.inc(audio_s, tags={"model": model})
        if audio_s > 0:
            self.metrics.real_time_factor.observe(elapsed / audio_s, tags={"model": model})
        if time_to_first is not None:
            self.metrics.time_to_first_audio_ms.observe(time_to_first * 1000, tags={"model": model, "stream": "false"})

    def frame_cap_cut(self, model: str, what: str, frames: int) -> None:
        """A Talker request (`what`: a request, or a piece of a long input) that reached its frame cap without EOS,
        with no cap of its client's: its speech was cut there."""
        self.metrics.frame_cap_cuts.inc(tags={"model": model})
        logger.warning(f"{model}: {what} reached its frame cap ({frames} frames) without EOS: its speech is cut")

    def first_stream_audio(self, model: str, started: float) -> None:
        self.metrics.time_to_first_audio_ms.observe((time.perf_counter() - started) * 1000,
                                                    tags={"model": model, "stream": "true"})

    def first_audio_stages(self, model: str, timing: FirstAudioTiming) -> None:
        """Each stage of a request's first audio (deployments/first_audio_timing.py), one observation each."""
        for stage, ms in timing.stages_ms().items():
            self.metrics.first_audio_stage_ms.observe(max(ms, 0.0), tags={"model": model, "stage": stage})

    def stream_opened(self, model: str) -> None:
        self._open_streams[model] += 1
        self.metrics.open_streams.set(self._open_streams[model], tags={"model": model})

    def stream_ended(self, model: str, status: str, started: float, frames: int, playback: PlaybackClock,
                     record: RequestRecord | None = None) -> None:
        """A stream's end, however it ended: the open-stream gauge, what its listener would have heard, its count
        by `status` ("ok": with its audio) and its log line (HTTP 200: the status line went with the first byte;
        a WebSocket context's too)."""
        self._open_streams[model] -= 1
        self.metrics.open_streams.set(self._open_streams[model], tags={"model": model})
        if playback.started is not None and playback.min_lead_s != float("inf"):
            self.metrics.client_buffer_lead_s.observe(max(playback.min_lead_s, 0.0), tags={"model": model})
        if playback.underruns:
            self.metrics.client_dry_streams.inc(tags={"model": model})
            self.metrics.client_underruns.inc(playback.underruns, tags={"model": model})
            self.metrics.client_underrun_seconds.inc(playback.underrun_s, tags={"model": model})
        if status == "ok":
            self.finish(model, started, True, frames)
        else:
            self.count(model, status, True)
        if record is not None:
            record.end(status, CLIENT_CLOSED_STATUS if status == "cancelled" else 200,
                       frames * SAMPLES_PER_FRAME / SAMPLE_RATE)


@dataclass
class PlaybackClock:
    started: float | None = None  # monotonic time of the first byte
    audio_s: float = 0.0  # audio sent so far
    min_lead_s: float = float("inf")
    underruns: int = 0
    underrun_s: float = 0.0  # total silence the player waited through
    _in_underrun: bool = field(default=False, repr=False)

    def sent(self, audio_seconds: float, now: float | None = None) -> None:
        """Record `audio_seconds` of audio handed to the client at `now`."""
        now = time.monotonic() if now is None else now
        if self.started is None:
            self.started = now
        else:
            lead = self.audio_s - (now - self.started)
            self.min_lead_s = min(self.min_lead_s, lead)
            if lead < 0 and not self._in_underrun:
                self.underruns += 1
            self._in_underrun = lead < 0
            if lead < 0:  # the player waited: it restarts from this chunk
                self.started -= lead
                self.underrun_s -= lead
        self.audio_s += audio_seconds
