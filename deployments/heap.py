"""An engine replica's Python heap after its warm-up: collected once, frozen, and long collections logged.

Loading, compiling and capturing leave close to a million long-lived Python objects in a GPU engine replica
(torch.compile's graphs and guards, Triton's kernels, the CUDA graphs' wrappers) and tens of thousands of
unreachable ones in reference cycles. A full collection walks all of them while it holds the interpreter (about
half a second: docs/serving.md), which pauses the engine's thread and so every stream of the replica. `settle_after_warm_up`
collects once, while no request waits, and moves the survivors to the permanent generation (`gc.freeze`), which
later collections skip. `watch_collections` logs any collection that held the interpreter longer than a
threshold, so that such a pause shows in the replica's log rather than being guessed from a gap.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

Log = Callable[[str], None]

LONG_COLLECTION_S = 0.05  # a pause this long delays a 12.5 Hz stream's next frame noticeably


def settle_after_warm_up(log: Log) -> float:
    """Collect all generations, then freeze what survives; logs and returns the seconds it took."""
    t0 = time.perf_counter()
    collected = gc.collect()
    gc.freeze()
    spent = time.perf_counter() - t0
    log(f"heap settled after the warm-up in {spent * 1e3:.0f} ms: {collected} unreachable objects collected, "
        f"{gc.get_freeze_count()} frozen")
    return spent


class CollectionWatch:
    """A `gc.callbacks` entry that logs collections longer than `threshold_s` and counts them."""

    def __init__(self, log: Log, threshold_s: float = LONG_COLLECTION_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._log, self._threshold, self._clock = log, threshold_s, clock
        self._started: float | None = None
        self.long_collections = 0
        self.longest_s = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self._clock()
            return
        if self._started is None:
            return
        spent, self._started = self._clock() - self._started, None
        self.longest_s = max(self.longest_s, spent)
        if spent >= self._threshold:
            self.long_collections += 1
            self._log(f"a generation-{info.get('generation')} garbage collection held the interpreter for "
                      f"{spent * 1e3:.0f} ms ({info.get('collected')} objects collected)")

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def watch_collections(log: Log, threshold_s: float = LONG_COLLECTION_S) -> CollectionWatch:
    """The process's `CollectionWatch`, installed on first use (a process may host more than one server)."""
    for callback in gc.callbacks:
        if isinstance(callback, CollectionWatch):
            return callback
    watch = CollectionWatch(log, threshold_s)
    gc.callbacks.append(watch)
    return watch
