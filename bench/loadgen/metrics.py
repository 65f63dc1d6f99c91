"""Pure metric functions: percentiles, playback continuity (with and without rebuffering), aggregation.

Nothing here does I/O or reads a clock; every function takes plain numbers, so the tests can feed
synthetic arrival traces with known answers.

Continuity, the seeds' definition (vllm-omni `benchmarks/audio_continuity.py`): a player starts at the
first audio arrival and plays in real time without ever pausing. At each later arrival i, the deficit is
`(t_i - t_0) - (audio received before i)`; `max_deficit_s` is the worst one and `underrun_events` counts
arrivals with a positive deficit. One early stall therefore counts at every later arrival. A stream is
"continuous" when `max_deficit_s <= threshold` (0.1 s).

The rebuffering variant is what a real player does: when the buffer runs dry it pauses, and resumes once
`resume_s` of audio is buffered again (0: as soon as any audio arrives). It reports the number of stalls
and the time spent stalled; a stall no longer carries over to later arrivals.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 24000
BYTES_PER_SAMPLE = 2  # s16le mono
BYTES_PER_SECOND = SAMPLE_RATE * BYTES_PER_SAMPLE
CONTINUITY_THRESHOLD_S = 0.1  # the seeds' default (VLLM_OMNI_BENCH_AUDIO_CONTINUITY_THRESHOLD_S)
PERCENTILES = (50, 90, 95, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), numpy's linear interpolation between order statistics; a plain float."""
    if len(values) == 0:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    return float(np.percentile(values, q))


@dataclass(frozen=True)
class Stats:
    """Summary of one metric over the requests of a load point; None fields when there were no values."""

    n: int
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p95: float | None = None
    p99: float | None = None
    min: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Stats:
        vals = [float(v) for v in values if v is not None]
        if not vals:
            return cls(n=0)
        p = {f"p{q}": percentile(vals, q) for q in PERCENTILES}
        return cls(n=len(vals), mean=sum(vals) / len(vals), min=min(vals), max=max(vals), **p)


# ---------------------------------------------------------------------------------------------- continuity
@dataclass(frozen=True)
class Continuity:
    """No-rebuffer player (the seeds' definition)."""

    max_deficit_s: float
    underrun_events: int
    worst_index: int | None = None  # the arrival with the worst deficit (None: no deficit)

    def continuous(self, threshold_s: float = CONTINUITY_THRESHOLD_S) -> bool:
        return self.max_deficit_s <= threshold_s


def continuity(arrival_s: Sequence[float], audio_s: Sequence[float]) -> Continuity:
    """Worst playback deficit of a player that starts at the first arrival and never pauses.

    arrival_s: arrival times of the audio pieces (any origin, non-decreasing); audio_s: seconds of audio
    in each piece. Pieces before the first audible one must be dropped by the caller.
    """
    _check_trace(arrival_s, audio_s)
    if not arrival_s:
        return Continuity(0.0, 0)
    t0, received, worst, worst_index, events = arrival_s[0], 0.0, 0.0, None, 0
    for i, t in enumerate(arrival_s):
        if i > 0:
            deficit = (t - t0) - received
            if deficit > 0:
                events += 1
                if deficit > worst:
                    worst, worst_index = deficit, i
        received += audio_s[i]
    return Continuity(worst, events, worst_index)


@dataclass(frozen=True)
class Rebuffering:
    """A player that pauses when its buffer runs dry and resumes when `resume_s` is buffered again."""

    stalls: int
    stall_s: float
    max_stall_s: float


def rebuffering(arrival_s: Sequence[float], audio_s: Sequence[float], resume_s: float = 0.0) -> Rebuffering:
    """Stalls of a real player. It starts at the first arrival; when the stream ends while stalled, playback
    resumes at the last arrival (there is nothing more to wait for)."""
    _check_trace(arrival_s, audio_s)
    if resume_s < 0:
        raise ValueError("resume_s must be >= 0")
    if not arrival_s:
        return Rebuffering(0, 0.0, 0.0)
    clock, buffered, playing = arrival_s[0], audio_s[0], True
    stall_start, stalls, total, worst = 0.0, 0, 0.0, 0.0
    for t, piece in zip(arrival_s[1:], audio_s[1:], strict=True):
        if playing:
            if buffered >= t - clock:
                buffered -= t - clock
            else:  # ran dry between the previous arrival and this one
                stall_start, buffered, playing = clock + buffered, 0.0, False
                stalls += 1
        clock = t
        buffered += piece
        if not playing and buffered > 0 and buffered >= resume_s:
            playing = True
            total, worst = total + (t - stall_start), max(worst, t - stall_start)
    if not playing:
        total, worst = total + (clock - stall_start), max(worst, clock - stall_start)
    return Rebuffering(stalls, total, worst)


def _check_trace(arrival_s: Sequence[float], audio_s: Sequence[float]) -> None:
    if len(arrival_s) != len(audio_s):
        raise ValueError(f"{len(arrival_s)} arrival times but {len(audio_s)} audio pieces")
    if any(b < a for a, b in zip(arrival_s, arrival_s[1:], strict=False)):
        raise ValueError("arrival times must be non-decreasing")
    if any(a < 0 for a in audio_s):
        raise ValueError("audio durations must be >= 0")


def audio_seconds(n_bytes: int) -> float:
    return n_bytes / BYTES_PER_SECOND
