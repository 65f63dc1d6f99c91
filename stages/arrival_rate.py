"""How often something arrived lately: the rule every "wait for more to batch" decision asks (Code2Wav's batch
fill, the Talker's first-chunk decodes, the Talker engine's prefill hold); added up in seconds of work, a busy
share (Code2Wav's decoder). Torch-free."""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class ArrivalRate:
    """Items per second arriving lately: a count that decays with time constant `tau_s` (a steady rate r reads
    r after a few tau). A `hold` asks it whether waiting can pay: at one stream, chunks come ~100 ms apart and a
    20 ms wait only delays the one that waits."""

    def __init__(self, tau_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self._tau, self._clock = tau_s, clock
        self._level, self._at = 0.0, clock()

    def add(self, n: float) -> None:
        now = self._clock()
        self._level = self._decayed(now) + n
        self._at = now

    def per_second(self) -> float:
        return self._decayed(self._clock()) / self._tau

    def wait_if_more_expected(self, wait_s: float) -> float:
        """`wait_s` if at least one more item is expected within it at the current rate, else 0 (a `hold`'s
        answer: waiting for nothing only delays the batch that waits)."""
        return wait_s if self.per_second() * wait_s >= 1.0 else 0.0

    def _decayed(self, now: float) -> float:
        return self._level * math.exp(-max(0.0, now - self._at) / self._tau)
