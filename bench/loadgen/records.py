"""What one request and one load point record (plain dataclasses, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["closed", "open"]


@dataclass
class RequestResult:
    """One request. Times are seconds on the load point's clock (0 = the point started); `sent_s` is taken
    just before the request is written, and every latency is measured from it."""

    index: int
    text: str
    language: str
    scheduled_s: float = 0.0          # open loop: when it was due; closed loop: when a worker picked it up
    sent_s: float | None = None
    status: int | None = None         # HTTP status, None when no response came
    failure: str | None = None        # None = ok; else a kind: http_429, timeout, connect, truncated, aborted, ...
    error: str | None = None          # the server's message or the exception, shortened
    first_byte_s: float | None = None
    first_audio_s: float | None = None
    end_s: float | None = None        # last byte (or the failure)
    audio_bytes: int = 0
    expected_bytes: int | None = None  # fixed-length runs: the exact PCM size the server must send
    finish_reason: str | None = None  # SSE `done` event
    server_timing: dict[str, float] = field(default_factory=dict)  # the response's Server-Timing stages (ms)
    new_connection: bool | None = None  # aiohttp opened a connection for it (False: a kept-alive one; None: unknown)
    connect_s: float | None = None      # that connection's setup (TCP connect), part of every latency
    arrival_s: list[float] = field(default_factory=list)  # audible pieces: arrival times ...
    arrival_bytes: list[int] = field(default_factory=list)  # ... and their PCM bytes
    # SSE with `timestamps`: each timestamps event's delay after the last audio before it (the span it times ended)
    timestamps_lag_s: list[float] = field(default_factory=list)
    timestamps_failed: int = 0  # timestamps events that carry an error instead of words
    done: bool = False

    @property
    def ok(self) -> bool:
        return self.done and self.failure is None


@dataclass(frozen=True)
class LoadPoint:
    mode: Mode
    level: float      # concurrency (closed) or requests per second (open)
    requests: int


@dataclass
class PointRun:
    """The raw outcome of one load point."""

    point: LoadPoint
    results: list[RequestResult]
    started_s: float = 0.0
    wall_s: float = 0.0               # first send (closed) or first due time (open) to the last completion
    peak_inflight: int = 0
    loop_lag_s: list[float] = field(default_factory=list)  # event-loop lag samples of the load generator
    truncated: bool = False           # the sweep's time budget ended it early
