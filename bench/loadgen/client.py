"""One streaming `POST /v1/audio/speech` through aiohttp, timed piece by piece.

Many requests share one `aiohttp.ClientSession` (no connection limit) on one event loop. Each audible
piece of the body is timestamped as it arrives: raw PCM reads for `stream_format: audio` (a WAV body's
44-byte header is not audio), complete `speech.audio.delta` events for SSE.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from deployments.first_audio_timing import parse_server_timing

from .metrics import BYTES_PER_SAMPLE
from .records import RequestResult

SAMPLES_PER_FRAME = 1920  # 80 ms at 24 kHz
WAV_HEADER_BYTES = 44
ERROR_CHARS = 300


@dataclass(frozen=True)
class SpeechSettings:
    """The request body's fixed fields (the text varies per request)."""

    model: str | None = "tts-1"
    voice: str | None = "vivian"
    response_format: Literal["pcm", "wav"] = "pcm"
    stream_format: Literal["audio", "sse"] = "audio"
    max_new_tokens: int | None = None
    fixed_length: bool = False       # suppress EOS: exactly max_new_tokens frames (random weights never stop)
    extra: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.fixed_length and not self.max_new_tokens:
            raise ValueError("fixed-length outputs need max_new_tokens")

    def body(self, text: str) -> dict[str, Any]:
        body: dict[str, Any] = {"input": text, "stream": True, "response_format": self.response_format,
                                "stream_format": self.stream_format}
        for key in ("model", "voice", "max_new_tokens"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.fixed_length:
            body["suppress_eos"] = True
        return {**body, **self.extra}

    @property
    def expected_bytes(self) -> int | None:
        if self.fixed_length and self.max_new_tokens:
            return self.max_new_tokens * SAMPLES_PER_FRAME * BYTES_PER_SAMPLE
        return None


class SpeechClient:
    """Sends requests and fills their `RequestResult`; counts requests in flight."""

    def __init__(self, base_url: str, settings: SpeechSettings):
        self.url = base_url.rstrip("/") + "/v1/audio/speech"
        self.settings = settings
        self.inflight = 0
        self.peak_inflight = 0
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SpeechClient:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                              trace_configs=[_connection_tracing()])
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    def reset_peak(self) -> None:
        self.peak_inflight = self.inflight

    def worker_loop_lag(self) -> list[float]:
        return []  # no workers: the load point measures this loop's lag itself

    async def synthesize(self, r: RequestResult, origin: float) -> None:
        """Run request `r`; times are `time.perf_counter() - origin`. Never raises except on cancellation
        (then `r.failure == "aborted"`)."""
        assert self._session is not None, "use `async with SpeechClient(...)`"

        def now() -> float:
            return time.perf_counter() - origin

        r.expected_bytes = self.settings.expected_bytes
        payload = json.dumps(self.settings.body(r.text)).encode()
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        r.sent_s = now()
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.timeout_s)
            async with self._session.post(self.url, data=payload, timeout=timeout, trace_request_ctx=r,
                                          headers={"content-type": "application/json"}) as resp:
                r.status = resp.status
                r.server_timing = parse_server_timing(resp.headers.get("server-timing", ""))
                if resp.status != 200:
                    r.first_byte_s = now()
                    r.failure, r.error = f"http_{resp.status}", _error_message(await resp.read())
                else:
                    reader = _SSEReader(r, now) if self.settings.stream_format == "sse" else _AudioReader(
                        r, now, WAV_HEADER_BYTES if self.settings.response_format == "wav" else 0)
                    async for data in resp.content.iter_any():
                        if r.first_byte_s is None:
                            r.first_byte_s = now()
                        reader.feed(data)
                    r.failure = r.failure or reader.finish()
        except asyncio.CancelledError:
            r.failure = "aborted"
            raise
        except TimeoutError:
            r.failure = "timeout"
        except aiohttp.ClientConnectorError as e:
            r.failure, r.error = "connect", str(e)[:ERROR_CHARS]
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as e:
            r.failure, r.error = "disconnected", str(e)[:ERROR_CHARS]
        except aiohttp.ClientError as e:
            r.failure, r.error = "client_error", f"{type(e).__name__}: {e}"[:ERROR_CHARS]
        except Exception as e:
            r.failure, r.error = type(e).__name__, str(e)[:ERROR_CHARS]
        finally:
            r.end_s = now()
            r.done = True
            self.inflight -= 1
        if r.ok and r.expected_bytes is not None and r.audio_bytes != r.expected_bytes:
            r.failure = "truncated" if r.audio_bytes < r.expected_bytes else "length_mismatch"
            r.error = f"{r.audio_bytes} PCM bytes, expected {r.expected_bytes}"


def _connection_tracing() -> aiohttp.TraceConfig:
    """Marks each request's `RequestResult` (its `trace_request_ctx`) with whether aiohttp opened a connection for
    it, and how long the connect took. In a burst, requests on new connections reached first audio ~40 ms later
    than those on kept-alive ones (H200, 2026-11-28): this tells the two apart in every run."""
    trace = aiohttp.TraceConfig()

    async def connect_started(session, ctx, params) -> None:
        ctx.connect_started = time.perf_counter()

    async def connected(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, RequestResult):
            ctx.trace_request_ctx.new_connection = True
            ctx.trace_request_ctx.connect_s = time.perf_counter() - ctx.connect_started

    async def reused(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, RequestResult):
            ctx.trace_request_ctx.new_connection = False

    trace.on_connection_create_start.append(connect_started)
    trace.on_connection_create_end.append(connected)
    trace.on_connection_reuseconn.append(reused)
    return trace


class _AudioReader:
    """Raw chunked body: every read that carries PCM is one arrival."""

    def __init__(self, r: RequestResult, now: Callable[[], float], header_bytes: int):
        self.r, self.now, self.skip = r, now, header_bytes

    def feed(self, data: bytes) -> None:
        if self.skip:
            cut = min(self.skip, len(data))
            data, self.skip = data[cut:], self.skip - cut
        if data:
            _arrive(self.r, self.now(), len(data))

    def finish(self) -> str | None:
        return None if self.r.audio_bytes else "empty"


class _SSEReader:
    """`data: {...}\\n\\n` events: each complete `speech.audio.delta` is one arrival."""

    def __init__(self, r: RequestResult, now: Callable[[], float]):
        self.r, self.now, self.buffer, self.ended = r, now, b"", False

    def feed(self, data: bytes) -> None:
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        t = self.now()
        for raw in events:
            payload = b"".join(line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:"))
            if not payload:
                continue
            event = json.loads(payload)
            kind = event.get("type")
            if kind == "speech.audio.delta":
                n = len(base64.b64decode(event.get("audio", "")))
                if n:
                    _arrive(self.r, t, n)
            elif kind == "speech.audio.timestamps":
                if self.r.arrival_s:
                    self.r.timestamps_lag_s.append(t - self.r.arrival_s[-1])
                self.r.timestamps_failed += "error" in event
            elif kind == "speech.audio.done":
                self.ended, self.r.finish_reason = True, event.get("finish_reason")
            elif kind == "speech.audio.error":
                self.ended = True
                self.r.failure = "stream_error"
                self.r.error = str(event.get("error", {}).get("message", event))[:ERROR_CHARS]

    def finish(self) -> str | None:
        if not self.ended:
            return "truncated"
        return None if self.r.audio_bytes or self.r.failure else "empty"


def _arrive(r: RequestResult, t: float, n: int) -> None:
    if r.first_audio_s is None:
        r.first_audio_s = t
    r.arrival_s.append(t)
    r.arrival_bytes.append(n)
    r.audio_bytes += n


def _error_message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:ERROR_CHARS]
    except (ValueError, KeyError, TypeError):
        return body[:ERROR_CHARS].decode("utf-8", "replace")
