"""Load shapes: closed loop (c streams, each sends its next request when the last one ends) and open loop
(Poisson arrivals at r requests/s, sent whether or not earlier ones finished), and the sweep over levels.

A closed loop's streams start together by default: a burst of c requests in the same millisecond, the hardest
opening a server can get. `stagger_s` spreads their starts instead (stream k of c starts k x stagger_s / c after
the level's start), as listeners who arrive over a few seconds do; with fixed-length outputs the streams keep that
spread, so its first audio is the steady state's, not the burst's.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from .progress import Progress
from .records import LoadPoint, Mode, PointRun, RequestResult
from .sentences import Sentence
from .summary import PointSummary, summarize

LAG_TICK_S = 0.05


class Client(Protocol):
    """What a load point drives: `SpeechClient` (one event loop) or `fanout.ProcessPoolClient` (workers)."""

    inflight: int
    peak_inflight: int

    def reset_peak(self) -> None: ...

    def worker_loop_lag(self) -> list[float]:
        """Event-loop lag samples (s) of worker processes since the last call; [] without workers."""
        ...

    async def synthesize(self, r: RequestResult, origin: float) -> None: ...


@dataclass(frozen=True)
class SweepConfig:
    mode: Mode
    levels: tuple[float, ...]
    requests: int = 16                 # per point, at least
    requests_per_level: float = 0.0    # closed: n >= k x c; open: n >= k x r (k seconds of arrivals)
    warmup: int = 2
    seed: int = 0
    max_seconds: float | None = None   # the whole sweep's budget (warm-up included)
    stop_failure_rate: float | None = 0.0  # stop after a point whose failure rate exceeds this; None: never
    stop_ttfa_p95_ms: float | None = None
    continuity_threshold_s: float = 0.1
    rebuffer_resume_s: float = 0.0
    stagger_s: float = 0.0             # closed: stream k of c starts k x stagger_s / c after the level's start

    def requests_at(self, level: float) -> int:
        return max(self.requests, int(round(self.requests_per_level * level)), 1)


@dataclass
class SweepOutcome:
    runs: list[PointRun]
    summaries: list[PointSummary]
    stop_reason: str | None


def poisson_arrivals(rate: float, n: int, rng: random.Random) -> list[float]:
    """Due times (s) of n requests, the first at 0, exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def stream_start_s(k: int, streams: int, stagger_s: float) -> float:
    """When stream k of a closed loop's `streams` starts, seconds into the level (0 for all without a stagger)."""
    return k * stagger_s / max(1, streams)


async def lag_monitor(samples: list[float]) -> None:
    """How late the event loop wakes up: a busy load generator would inflate every latency it measures."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(LAG_TICK_S)
        samples.append(max(0.0, time.perf_counter() - t - LAG_TICK_S))


async def run_point(client: Client, point: LoadPoint, texts: list[Sentence], rng: random.Random,
                    deadline: float | None = None, progress: Progress | None = None, stagger_s: float = 0.0) -> PointRun:
    """One load point; `deadline` (perf_counter) cancels what is still running and marks it aborted."""
    results = [RequestResult(index=i, text=s.text, language=s.language) for i, s in enumerate(texts)]
    run = PointRun(point=point, results=results)
    origin = time.perf_counter()
    client.reset_peak()
    client.worker_loop_lag()  # drop what earlier points left
    lag = asyncio.create_task(lag_monitor(run.loop_lag_s))

    async def one(r: RequestResult) -> None:
        await client.synthesize(r, origin)
        if progress is not None:
            progress.update(ok=r.ok, inflight=client.inflight)

    if point.mode == "closed":
        body = _closed(results, int(point.level), one, origin, stagger_s)
    else:
        body = _open(results, poisson_arrivals(point.level, len(results), rng), one, origin)
    task = asyncio.create_task(body)
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            run.truncated = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    finally:
        lag.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lag
    run.loop_lag_s.extend(client.worker_loop_lag())  # the worst loop of all counts
    sent = [r for r in results if r.sent_s is not None]
    if sent:
        start = min(r.scheduled_s for r in sent)
        run.started_s = start
        run.wall_s = max(r.end_s or 0.0 for r in sent) - start
    run.peak_inflight = client.peak_inflight
    return run


async def _closed(results: list[RequestResult], concurrency: int, one: Callable[[RequestResult], Awaitable[None]],
                  origin: float, stagger_s: float = 0.0) -> None:
    queue = iter(results)
    streams = max(1, concurrency)

    async def worker(k: int) -> None:
        wait = stream_start_s(k, streams, stagger_s) - (time.perf_counter() - origin)
        if wait > 0:
            await asyncio.sleep(wait)  # the stream's arrival is a timer, as in the open loop
        for r in queue:  # one shared iterator: each worker takes the next request when its last one ends
            r.scheduled_s = time.perf_counter() - origin
            await one(r)

    workers = [asyncio.create_task(worker(k)) for k in range(streams)]
    try:
        await asyncio.gather(*workers)
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


async def _open(results: list[RequestResult], due: list[float], one: Callable[[RequestResult], Awaitable[None]],
                origin: float) -> None:
    tasks: list[asyncio.Task] = []
    try:
        for r, t in zip(results, due, strict=True):
            r.scheduled_s = t
            wait = t - (time.perf_counter() - origin)
            if wait > 0:
                await asyncio.sleep(wait)  # the arrival process is a timer: nothing else to await
            tasks.append(asyncio.create_task(one(r)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _stop_reason(cfg: SweepConfig, s: PointSummary) -> str | None:
    if cfg.stop_failure_rate is not None and s.failure_rate > cfg.stop_failure_rate:
        return f"failure rate {s.failure_rate:.1%} at {cfg.mode} level {s.level:g} ({s.failures})"
    if cfg.stop_ttfa_p95_ms is not None and s.ttfa_ms.p95 is not None and s.ttfa_ms.p95 > cfg.stop_ttfa_p95_ms:
        return f"TTFA p95 {s.ttfa_ms.p95:.0f} ms > {cfg.stop_ttfa_p95_ms:.0f} ms at level {s.level:g}"
    if s.ok == 0 and s.requests:
        return f"no request succeeded at level {s.level:g}"
    return None


async def sweep(client: Client, cfg: SweepConfig, draw: Callable[[random.Random, int], list[Sentence]],
                on_point: Callable[[SweepOutcome], None] | None = None,
                progress_factory: Callable[[str, int], Progress] | None = None) -> SweepOutcome:
    """Warm up, then run each level in order until one fails the stop rule or the budget ends."""
    started = time.perf_counter()
    deadline = None if cfg.max_seconds is None else started + cfg.max_seconds
    rng = random.Random(cfg.seed)
    outcome = SweepOutcome([], [], None)
    if cfg.warmup:
        warm = LoadPoint("closed", min(cfg.warmup, 4), cfg.warmup)
        await run_point(client, warm, draw(rng, cfg.warmup), rng, deadline)
    for level in cfg.levels:
        if deadline is not None and time.perf_counter() >= deadline:
            outcome.stop_reason = f"time budget ({cfg.max_seconds:g} s) spent before level {level:g}"
            break
        point = LoadPoint(cfg.mode, level, cfg.requests_at(level))
        progress = progress_factory(f"{cfg.mode} {level:g}", point.requests) if progress_factory else None
        try:
            run = await run_point(client, point, draw(rng, point.requests), rng, deadline, progress, cfg.stagger_s)
        finally:
            if progress is not None:
                progress.close()
        summary = summarize(run, cfg.continuity_threshold_s, cfg.rebuffer_resume_s)
        outcome.runs.append(run)
        outcome.summaries.append(summary)
        outcome.stop_reason = _stop_reason(cfg, summary)
        if run.truncated:
            outcome.stop_reason = f"time budget ({cfg.max_seconds:g} s) ended level {level:g}"
        if on_point is not None:
            on_point(outcome)
        if outcome.stop_reason:
            break
    return outcome
