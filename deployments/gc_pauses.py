"""GcPauses: how long Python's cyclic garbage collector stops a replica, by generation.

A collection holds the GIL for its whole pass, so every thread of the process waits: in a Talker replica that is
the engine thread, whose next step launch then comes late and leaves the GPU idle (`EngineStats.device_clock`
shows such gaps). A full collection walks every tracked object not frozen, and a replica that imported torch, Ray
and the model holds hundreds of thousands: in a CPU process with a started Talker server (0.38 M objects) a full
pass took ~150 ms on this project's CPU machine. Ray Serve already moves a replica's start-up heap out of the
collector's way (`RAY_SERVE_FREEZE_GC_ON_STARTUP`, on by default: `gc.collect()` and `gc.freeze()` once the
replica's `__init__` returned); `frozen` reports how many objects that left in the permanent generation, and the
pauses show what collections cost under load (docs/serving.md "Garbage collections").
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
    frozen: int = 0  # objects in the permanent generation (gc.freeze) when read


class GcPauses:
    """Times every collection of this process (a `gc.callbacks` hook) until `close()`."""

    def __init__(self):
        self._stats = GcPauseStats()
        self._started_at = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        pause, generation, s = time.perf_counter() - self._started_at, info["generation"], self._stats
        s.collections[generation] += 1
        s.seconds[generation] += pause
        if pause > LONG_PAUSE_S:
            s.long_pauses += 1
            s.long_pause_seconds += pause

    def stats(self) -> GcPauseStats:
        """The counts so far (a copy) and the frozen objects now."""
        s = self._stats
        return GcPauseStats(list(s.collections), list(s.seconds), s.long_pauses, s.long_pause_seconds,
                            gc.get_freeze_count())

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
