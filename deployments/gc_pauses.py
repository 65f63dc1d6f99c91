"""GcPauses: how long Python's cyclic garbage collector stops a replica, by generation; `freeze_heap` after start-up.

A collection holds the GIL for its whole run, so every thread of the process waits: in a Talker replica that is
the engine thread, whose next step launch then comes late and leaves the GPU idle (its `EngineStats.device_clock`
shows such gaps). A full collection walks every tracked object, and a replica that imported torch, Ray and the
model holds hundreds of thousands (a full pass over them measured ~200 ms on a slow CPU). `freeze_heap` moves
everything alive after start-up (modules, weights' wrappers, graphs, caches) to the permanent generation, so that
later collections walk only what was allocated since: `gc.freeze()`, after one collection to leave no garbage in it.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

LONG_PAUSE_S = 5e-3  # a pause this long costs a Talker at least one step's launch


@dataclass
class GcPauseStats:
    collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # by generation
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    long_pauses: int = 0  # collections of any generation over LONG_PAUSE_S
    long_pause_seconds: float = 0.0
    frozen: int = 0  # objects moved to the permanent generation by freeze_heap


class GcPauses:
    """Times every collection of this process (a `gc.callbacks` hook) until `close()`."""

    def __init__(self):
        self.stats = GcPauseStats()
        self._started_at = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        pause, generation, s = time.perf_counter() - self._started_at, info["generation"], self.stats
        s.collections[generation] += 1
        s.seconds[generation] += pause
        if pause > LONG_PAUSE_S:
            s.long_pauses += 1
            s.long_pause_seconds += pause

    def freeze_heap(self) -> int:
        """Collect once, then freeze what is alive: later collections skip it. Returns the objects frozen."""
        gc.collect()
        gc.freeze()
        self.stats.frozen = gc.get_freeze_count()
        return self.stats.frozen

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
