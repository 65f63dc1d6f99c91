"""StepClock: the device's own clock around each decode step, to tell a slow step from a late one.

The engine thread's timers see the host: how long it launched, and how long it waited for a step's output. On a
shared GPU (another process's kernels, a second stream) they cannot say whether a step ran longer on the device
or the device waited between steps, for prefills or for the host's next launch. Two timing events per step, read
when the host reads the step, can (`DeviceClockStats`):
- `step_seconds`: each step from the stream reaching it to its output copied (its kernels, slowed by whatever
  shared the GPU meanwhile);
- the gap before a step, from the step before it ending to it starting, for steps launched while the one before
  was still unread (the engine keeps one step queued ahead; after an idle engine there is no gap to count): with
  prefills launched between the two (`prefill_gap_*`; an event where the first of them begins, once the host has
  staged it, and one where the last of them ends split it into `prefill_wait_seconds`, the device idle before
  the first (for the host's staging, or the GIL), `prefill_device_seconds`, the prefills' own device time (and
  any wait for the launches after the first), and the rest, the device waiting for the step's launch after
  them), or without (`idle_gap_*`: the device waiting for the host's launch alone;
  `long_idle_gap_*`: those over LONG_IDLE_GAP_S, the stalls of a host thread held up, e.g. by the GIL or a
  garbage collection).

The last RECENT_STEPS steps are also kept one by one (`recent_steps`): when the host began each and its device time.
An interval between two launches far longer than a step says the loop stalled; whether the device was busy through
it (its step ran long: a GPU shared with another process) or idle (the host was late) is the share of the step's
device time in it, which the sums above cannot tell apart when the stalls come in waves.

Torch-free: the runner passes its event factory (`torch.cuda.Event(enable_timing=True)`); without one (CPU)
nothing is recorded.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

RING = 4  # steps whose events are alive at once; the engine has at most two launched and unread, and reads them
# in launch order, so step k's events are slot k % RING: launched and read counts say which slot is which
LONG_IDLE_GAP_S = 1e-3
RECENT_STEPS = 2048  # steps kept one by one (`recent_steps`)
LONG_LAUNCH_INTERVAL_S = 0.03  # a launch this long after the one before: a stall of the loop (`recent_steps`)


class TimingEvent(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: TimingEvent) -> float: ...  # milliseconds from this event to `end`


@dataclass
class DeviceClockStats:
    steps: int = 0  # steps timed (read)
    step_seconds: float = 0.0
    idle_gaps: int = 0
    idle_gap_seconds: float = 0.0
    long_idle_gaps: int = 0
    long_idle_gap_seconds: float = 0.0
    prefill_gaps: int = 0
    prefill_gap_seconds: float = 0.0
    prefill_wait_seconds: float = 0.0  # of prefill_gap_seconds, before the first prefill began
    prefill_device_seconds: float = 0.0  # of prefill_gap_seconds, from the first prefill's start to the last's end


class StepClock:
    def __init__(self, new_event: Callable[[], TimingEvent] | None, host_clock: Callable[[], float] = time.monotonic):
        self._events = [(new_event(), new_event()) for _ in range(RING)] if new_event else []
        self._prefill_events = [(new_event(), new_event()) for _ in range(RING)] if new_event else []
        self._chained = [False] * RING  # slot -> its step queued behind an unread one
        self._after_prefill = [False] * RING  # slot -> prefills were launched between it and the step before
        self._prefilled = False
        self._launched = self._read = 0
        self.stats = DeviceClockStats()
        self._host_clock = host_clock
        self._begun_at = [0.0] * RING  # slot -> host time its step began
        # (host time it began, device seconds, launched behind an unread step: the engine was busy, not idle)
        self._recent: collections.deque[tuple[float, float, bool]] = collections.deque(maxlen=RECENT_STEPS)
        self._recent_lock = threading.Lock()  # appended by the engine thread, read by a stats caller

    def prefill_begin(self) -> None:
        """A prefill, staged on the host, is about to be enqueued: it runs between the last launched step and the
        next."""
        if self._events and not self._prefilled:  # the first since the last step: where the prefills begin
            for event in self._prefill_events[self._launched % RING]:  # the end too: recorded even if this one fails
                event.record()
        self._prefilled = True

    def prefill_end(self) -> None:
        """After a prefill's last work is enqueued (each one marks it again: the last before the step counts)."""
        if self._events:
            self._prefill_events[self._launched % RING][1].record()

    def begin(self) -> None:
        """Before a step's first kernel is enqueued."""
        slot = self._launched % RING
        self._launched += 1
        if self._events:
            self._begun_at[slot] = self._host_clock()
            self._chained[slot] = self._launched - 1 > self._read  # the step before it is still unread
            self._after_prefill[slot], self._prefilled = self._prefilled, False
            self._events[slot][0].record()

    def end(self) -> None:
        """After the last begun step's last work (its output's copy) is enqueued."""
        if self._events:
            self._events[(self._launched - 1) % RING][1].record()

    def read(self) -> None:
        """Once the oldest unread step's output is ready (its events have completed): add its times."""
        slot = self._read % RING
        self._read += 1
        if not self._events:
            return
        s = self.stats
        start, end = self._events[slot]
        step_s = start.elapsed_time(end) * 1e-3
        s.steps += 1
        s.step_seconds += step_s
        with self._recent_lock:
            self._recent.append((self._begun_at[slot], step_s, self._chained[slot]))
        if not self._chained[slot]:
            return
        gap = self._events[slot - 1][1].elapsed_time(start) * 1e-3
        if self._after_prefill[slot]:
            s.prefill_gaps += 1
            s.prefill_gap_seconds += gap
            first, last = self._prefill_events[slot]
            s.prefill_wait_seconds += self._events[slot - 1][1].elapsed_time(first) * 1e-3
            s.prefill_device_seconds += first.elapsed_time(last) * 1e-3
            return
        s.idle_gaps += 1
        s.idle_gap_seconds += gap
        if gap > LONG_IDLE_GAP_S:
            s.long_idle_gaps += 1
            s.long_idle_gap_seconds += gap

    def recent_steps(self) -> dict:
        """The last RECENT_STEPS steps read: percentiles (p50, p95, p99, max; ms) of the interval between two
        launches while the engine was busy (a step launched behind an unread one: not after an idle engine) and of
        a step's device time; how many of those intervals were longer than LONG_LAUNCH_INTERVAL_S and the share of
        them the step launched first kept the device busy (near 1: the device was slow, e.g. shared; near 0: the
        host launched late). Empty without a device clock or with fewer than two such steps."""
        with self._recent_lock:
            recent = np.array(self._recent, dtype=np.float64).reshape(-1, 3)
        busy = recent[1:, 2] > 0  # interval k-1 -> k: step k launched behind an unread one
        if not busy.any():
            return {}
        intervals, steps = np.diff(recent[:, 0])[busy], recent[:-1, 1][busy]  # and the step that began it
        long = intervals > LONG_LAUNCH_INTERVAL_S

        def ms(x: np.ndarray) -> list[float]:
            return [round(float(v) * 1e3, 3) for v in (*np.percentile(x, [50, 95, 99]), x.max())]

        return {"steps": len(recent), "launch_interval_ms": ms(intervals), "gpu_step_ms": ms(recent[:, 1]),
                "long_intervals": int(long.sum()),
                "long_interval_gpu_share": round(float(np.minimum(steps[long], intervals[long]).sum()
                                                       / intervals[long].sum()), 3) if long.any() else None}


def window_ms(before: DeviceClockStats, after: DeviceClockStats) -> dict[str, float]:
    """What the device did per timed step between two reads of the stats (the GPU's period per step is
    step + idle gap + prefill gap; of the prefill gap, `gpu_prefill_wait_ms` before the first prefill and
    `gpu_prefill_device_ms` the prefills themselves), the mean device time of one prefill gap's prefills, and
    the long idle gaps (count, mean ms)."""
    steps = max(after.steps - before.steps, 1)

    def per_step(key: str) -> float:
        return (getattr(after, key) - getattr(before, key)) / steps * 1e3

    long_gaps = after.long_idle_gaps - before.long_idle_gaps
    prefill_gaps = after.prefill_gaps - before.prefill_gaps
    return {
        "gpu_step_ms": per_step("step_seconds"), "gpu_idle_gap_ms": per_step("idle_gap_seconds"),
        "gpu_prefill_gap_ms": per_step("prefill_gap_seconds"), "gpu_prefill_gaps": prefill_gaps,
        "gpu_prefill_wait_ms": per_step("prefill_wait_seconds"), "gpu_prefill_device_ms": per_step("prefill_device_seconds"),
        "gpu_ms_per_prefill_gap":
            (after.prefill_device_seconds - before.prefill_device_seconds) / max(prefill_gaps, 1) * 1e3,
        "gpu_long_idle_gaps": long_gaps,
        "gpu_long_idle_gap_mean_ms": (after.long_idle_gap_seconds - before.long_idle_gap_seconds)
        / max(long_gaps, 1) * 1e3,
    }
