"""One structured log line per request: what an operator greps for, in the ingress replica's log.

Each speech request (and each WebSocket context) ends in exactly one INFO line whose message is a JSON object:

    {"event": "tts.request", "request_id": ..., "engine_request_id": ..., "route": "speech", "model": ...,
     "voice": ..., "key_hash": ..., "input_chars": ..., "stream": ..., "audio_s": ..., "first_audio_ms": ...,
     "rtf": ..., "duration_ms": ..., "outcome": ..., "status": ...}

`request_id` is Serve's (the `X-Request-Id` the client got back); `engine_request_id` names the request in the
Talker's and Code2Wav's logs. `outcome` is the `status` tag of `tts_requests` (ok, bad_request, not_found,
rejected, cancelled, timeout, error); `first_audio_ms` runs from arrival (a WebSocket context: from its first
text, as `tts_time_to_first_audio_ms`); `status` the HTTP status the client got (a stream that fails after its
first byte was already a 200; a client that left: 499). `key_hash` is the first 8 hex digits of the SHA-256 of the
API key the request carried (never the key; the `key` label of the metrics), or null. `rtf` = duration / audio_s.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

logger = logging.getLogger("ray.serve")
# the request's span (docs/serving.md, "Traces"): a no-op unless Serve's tracing_config set a tracer provider
tracer = trace.get_tracer("qwen3_tts_serve.ingress")

EVENT = "tts.request"
CLIENT_CLOSED_STATUS = 499  # the client went away before its answer (nginx's code)


def key_hash(authorization: str | None = None, token: str | None = None) -> str | None:
    """The hash that names an API key in logs: from `Authorization: Bearer <key>` or a `token` (query parameter, a
    WebSocket's first message); None without a key."""
    key = token
    if authorization:
        scheme, _, value = authorization.strip().partition(" ")
        key = value.strip() if scheme.lower() == "bearer" else authorization.strip()
    if not key:
        return None
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:8]  # ApiKey.label


def serve_request_id() -> str | None:
    """Serve's id of the HTTP request being answered (its `X-Request-Id`), when there is one."""
    try:
        from ray.serve.context import _get_serve_request_context

        return _get_serve_request_context().request_id or None
    except Exception:  # outside a replica (unit tests)
        return None


@dataclass
class RequestRecord:
    """What the log line says about one request, filled in as it runs; `end` writes the line once."""

    engine_request_id: str
    route: str  # "speech" | "live"
    input_chars: int
    stream: bool
    voice: str | None = None
    key_hash: str | None = None
    request_id: str | None = field(default_factory=serve_request_id)
    model: str = "-"
    started: float = field(default_factory=time.perf_counter)
    first_audio_ms: float | None = None
    ended: dict | None = field(default=None, repr=False)
    span: Any = field(default=None, repr=False)  # `tts.request`: from arrival to `end`

    def __post_init__(self) -> None:
        self.span = tracer.start_span(f"tts.request {self.route}", kind=trace.SpanKind.SERVER, attributes={
            "tts.route": self.route, "tts.engine_request_id": self.engine_request_id, "tts.stream": self.stream})

    def first_audio(self, since: float | None = None) -> None:
        """The first audio went out now; timed from arrival, or from `since` (a live context: its first text)."""
        if self.first_audio_ms is None:
            self.first_audio_ms = (time.perf_counter() - (self.started if since is None else since)) * 1000
            self.span.add_event("first_audio", {"tts.first_audio_ms": self.first_audio_ms})

    def end(self, outcome: str, status: int, audio_s: float = 0.0) -> dict:
        """Write the line (the first call only: a request ends once) -> its fields."""
        if self.ended is not None:
            return self.ended
        duration_s = time.perf_counter() - self.started
        self.ended = {
            "event": EVENT, "request_id": self.request_id or self.engine_request_id,
            "engine_request_id": self.engine_request_id, "route": self.route, "model": self.model,
            "voice": self.voice, "key_hash": self.key_hash, "input_chars": self.input_chars, "stream": self.stream,
            "audio_s": round(audio_s, 3),
            "first_audio_ms": None if self.first_audio_ms is None else round(self.first_audio_ms, 1),
            "rtf": round(duration_s / audio_s, 4) if audio_s > 0 else None,
            "duration_ms": round(duration_s * 1000, 1), "outcome": outcome, "status": status,
        }
        logger.info(json.dumps(self.ended, separators=(",", ":")))
        self.span.set_attributes({f"tts.{k}": v for k, v in self.ended.items() if v is not None and k != "event"})
        if outcome not in ("ok", "cancelled"):
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, outcome))
        self.span.end()
        return self.ended
