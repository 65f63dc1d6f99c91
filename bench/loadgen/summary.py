"""Aggregate the requests of a load point into the figures users feel (pure)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from deployments.first_audio_timing import STAGES

from .metrics import CONTINUITY_THRESHOLD_S, Stats, audio_seconds, continuity, rebuffering
from .records import PointRun, RequestResult


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request figures (what the JSON keeps of each request)."""

    index: int
    ok: bool
    failure: str | None
    status: int | None
    chars: int
    send_lag_ms: float | None        # sent - due (open loop: the load generator falling behind)
    ttfb_ms: float | None
    ttfa_ms: float | None
    e2e_ms: float | None
    audio_s: float
    rtf: float | None                # e2e / audio duration
    pieces: int
    max_deficit_s: float | None
    underrun_events: int | None
    stalls: int | None
    stall_s: float | None
    error: str | None = None
    server_timing_ms: dict[str, float] | None = None  # the server's first-audio stages + `client_side`
    new_connection: bool | None = None  # sent on a connection opened for it (False: kept alive; None: unknown)
    connect_ms: float | None = None     # that connection's setup
    timestamps_lag_ms: list[float] = field(default_factory=list)  # SSE timestamps events after their span's audio
    timestamps_failed: int = 0


@dataclass(frozen=True)
class PointSummary:
    mode: str
    level: float
    requests: int
    ok: int
    failed: int
    aborted: int                     # cancelled by the time budget: neither ok nor failed
    failures: dict[str, int]
    failure_rate: float
    wall_s: float
    audio_s: float
    audio_s_per_s: float
    requests_per_s: float
    peak_inflight: int
    truncated: bool
    ttfa_ms: Stats
    ttfb_ms: Stats
    e2e_ms: Stats
    rtf: Stats
    audio_len_s: Stats
    max_deficit_s: Stats
    underrun_events_mean: float | None
    continuous_share: float | None   # ok streams with max deficit <= threshold (no rebuffer)
    stalls_mean: float | None        # rebuffering player
    stall_s: Stats
    stall_free_share: float | None   # rebuffering player: no stall at all
    stall_ok_share: float | None     # rebuffering player: stalled <= threshold in all
    send_lag_ms: Stats
    loop_lag_ms: Stats
    continuity_threshold_s: float
    rebuffer_resume_s: float
    # per stage of the first audio, from the responses' Server-Timing (deployments/first_audio_timing.py), plus
    # `client_side`: the client's TTFA minus the server's `total` (the client's hops and any proxy)
    server_timing_ms: dict[str, Stats] = field(default_factory=dict)
    # the client's connections (bench/loadgen/client.py's tracing): ok requests sent on a connection opened for
    # them, its setup, and `client_side` on new against kept-alive connections
    new_connections: int = 0
    connect_ms: Stats = field(default_factory=lambda: Stats(n=0))
    client_side_new_ms: Stats = field(default_factory=lambda: Stats(n=0))
    client_side_kept_ms: Stats = field(default_factory=lambda: Stats(n=0))
    # `timestamps` runs: how long after its span's last audio each timestamps event came, and events without words
    timestamps_lag_ms: Stats = field(default_factory=lambda: Stats(n=0))
    timestamps_failed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def request_metrics(r: RequestResult, resume_s: float = 0.0) -> RequestMetrics:
    def ms(t: float | None) -> float | None:
        return None if t is None or r.sent_s is None else (t - r.sent_s) * 1000

    audio_s = audio_seconds(r.audio_bytes)
    e2e = ms(r.end_s)
    ttfa = ms(r.first_audio_s)
    timing = dict(r.server_timing) or None
    if timing is not None and ttfa is not None and "total" in timing:
        timing["client_side"] = ttfa - timing["total"]
    cont = reb = None
    if r.ok and r.arrival_s:
        pieces = [audio_seconds(b) for b in r.arrival_bytes]
        cont, reb = continuity(r.arrival_s, pieces), rebuffering(r.arrival_s, pieces, resume_s)
    return RequestMetrics(
        index=r.index, ok=r.ok, failure=r.failure, status=r.status, chars=len(r.text),
        send_lag_ms=None if r.sent_s is None else max(0.0, r.sent_s - r.scheduled_s) * 1000,
        ttfb_ms=ms(r.first_byte_s), ttfa_ms=ttfa, e2e_ms=e2e, audio_s=audio_s,
        rtf=(e2e / 1000 / audio_s) if (r.ok and e2e is not None and audio_s > 0) else None,
        pieces=len(r.arrival_s),
        max_deficit_s=cont.max_deficit_s if cont else None, underrun_events=cont.underrun_events if cont else None,
        stalls=reb.stalls if reb else None, stall_s=reb.stall_s if reb else None,
        error=r.error, server_timing_ms=timing, new_connection=r.new_connection,
        connect_ms=None if r.connect_s is None else r.connect_s * 1000,
        timestamps_lag_ms=[x * 1000 for x in r.timestamps_lag_s], timestamps_failed=r.timestamps_failed,
    )


def summarize(run: PointRun, threshold_s: float = CONTINUITY_THRESHOLD_S, resume_s: float = 0.0) -> PointSummary:
    rows = [request_metrics(r, resume_s) for r in run.results]
    ok = [m for m in rows if m.ok]
    aborted = [m for m in rows if m.failure == "aborted"]
    failed = [m for m in rows if not m.ok and m.failure not in (None, "aborted")]
    not_started = [m for m in rows if not m.ok and m.failure is None]  # never sent (budget ended the point)
    audio_total = sum(m.audio_s for m in ok)
    streamed = [m for m in ok if m.max_deficit_s is not None]

    def share(pred, items) -> float | None:
        return sum(1 for m in items if pred(m)) / len(items) if items else None

    def mean(values) -> float | None:
        vals = [v for v in values if v is not None]
        return sum(vals) / len(vals) if vals else None

    decided = len(ok) + len(failed)
    return PointSummary(
        mode=run.point.mode, level=run.point.level, requests=len(rows), ok=len(ok), failed=len(failed),
        aborted=len(aborted) + len(not_started), failures=dict(sorted(Counter(m.failure for m in failed).items())),
        failure_rate=len(failed) / decided if decided else 0.0,
        wall_s=run.wall_s, audio_s=audio_total,
        audio_s_per_s=audio_total / run.wall_s if run.wall_s > 0 else 0.0,
        requests_per_s=len(ok) / run.wall_s if run.wall_s > 0 else 0.0,
        peak_inflight=run.peak_inflight, truncated=run.truncated,
        ttfa_ms=Stats.of(m.ttfa_ms for m in ok), ttfb_ms=Stats.of(m.ttfb_ms for m in ok),
        e2e_ms=Stats.of(m.e2e_ms for m in ok), rtf=Stats.of(m.rtf for m in ok),
        audio_len_s=Stats.of(m.audio_s for m in ok),
        max_deficit_s=Stats.of(m.max_deficit_s for m in streamed),
        underrun_events_mean=mean(m.underrun_events for m in streamed),
        continuous_share=share(lambda m: m.max_deficit_s <= threshold_s, streamed),
        stalls_mean=mean(m.stalls for m in streamed),
        stall_s=Stats.of(m.stall_s for m in streamed),
        stall_free_share=share(lambda m: m.stalls == 0, streamed),
        stall_ok_share=share(lambda m: m.stall_s <= threshold_s, streamed),
        send_lag_ms=Stats.of(m.send_lag_ms for m in rows),
        loop_lag_ms=Stats.of(x * 1000 for x in run.loop_lag_s),
        continuity_threshold_s=threshold_s, rebuffer_resume_s=resume_s,
        server_timing_ms=_stage_stats(m.server_timing_ms for m in ok),
        new_connections=sum(1 for m in ok if m.new_connection),
        connect_ms=Stats.of(m.connect_ms for m in ok),
        client_side_new_ms=Stats.of(_client_side(m) for m in ok if m.new_connection),
        client_side_kept_ms=Stats.of(_client_side(m) for m in ok if m.new_connection is False),
        timestamps_lag_ms=Stats.of(x for m in ok for x in m.timestamps_lag_ms),
        timestamps_failed=sum(m.timestamps_failed for m in ok),
    )


def _client_side(m: RequestMetrics) -> float | None:
    return (m.server_timing_ms or {}).get("client_side")


def _stage_stats(timings) -> dict[str, Stats]:
    """Stats per Server-Timing stage over the requests that reported it, in path order (requests may take
    different paths: a first chunk the Talker decoded has no Code2Wav stages), `client_side` last."""
    values: dict[str, list[float]] = {}
    for timing in timings:
        for stage, ms in (timing or {}).items():
            values.setdefault(stage, []).append(ms)
    order = {stage: i for i, stage in enumerate([*STAGES, "client_side"])}
    return {stage: Stats.of(values[stage]) for stage in sorted(values, key=lambda s: order.get(s, len(order)))}
