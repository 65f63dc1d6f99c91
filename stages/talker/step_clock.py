"""StepClock: the device's own clock around each decode step, to tell a slow step from a late one.

The engine thread's timers see the host: how long it launched, and how long it waited for a step's output. Under
a shared GPU (another process's kernels, a second stream) those cannot say whether the step itself ran longer on
the device or the device waited between steps (prefills, or the host launching late). Two timing events per step,
read when the host reads the step, can: `step_seconds` sums each step's time from the stream reaching it to its
output copied; `gap_seconds` sums, over `gaps` steps, the time from the step before it ending to it starting,
for steps launched while the one before was still unread (an engine that went idle between them has no gap).

Torch-free: the runner passes its event factory (`torch.cuda.Event(enable_timing=True)`); without one (CPU)
nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

RING = 4  # steps whose events are alive at once; the engine has at most two launched and unread


class TimingEvent(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: TimingEvent) -> float: ...  # milliseconds from this event to `end`


class StepClock:
    def __init__(self, new_event: Callable[[], TimingEvent] | None):
        self._events = [(new_event(), new_event()) for _ in range(RING)] if new_event else []
        self._slot_of_turn: dict[int, int] = {}
        self._chained = [False] * RING
        self._launched = self._read = 0
        self.step_seconds = self.gap_seconds = 0.0
        self.gaps = 0

    def begin(self, turn: int) -> None:
        """Before a step's first kernel is enqueued; `turn` names it until it is read."""
        slot = self._slot_of_turn[turn] = self._launched % RING
        self._launched += 1
        if self._events:
            self._chained[slot] = self._launched - 1 > self._read  # the step before it is still unread
            self._events[slot][0].record()

    def end(self, turn: int) -> None:
        """After the step's last work (its output's copy) is enqueued."""
        if self._events:
            self._events[self._slot_of_turn[turn]][1].record()

    def read(self, turn: int) -> None:
        """Once the step's output is ready (its events have completed): add its times."""
        self._read += 1
        if not self._events:
            return
        slot = self._slot_of_turn[turn]
        start, end = self._events[slot]
        self.step_seconds += start.elapsed_time(end) * 1e-3
        if self._chained[slot]:
            self.gap_seconds += self._events[slot - 1][1].elapsed_time(start) * 1e-3
            self.gaps += 1
