"""LoopLag: how late a replica's event loop runs what is ready to run, sampled every few milliseconds.

A replica's event loop carries every call's start, every streamed item and every WebSocket message of that
replica; when something holds it (Python work of many calls at once, or another thread holding the GIL), each of
them waits behind it, and that wait shows in the first-audio stages of the requests only as part of a hop. A task
that sleeps `interval_s` and notes how much later than asked it woke measures that wait directly: the delay any
callback becoming ready at that moment would have seen. The counts are cumulative since the replica started (a
histogram, its sum and its worst), so a reader takes two snapshots and subtracts them for a window
(`bench/replica_stats.py`). Serve samples its own loops too, but once per 5 s: too sparse for a burst of arrivals.

A loop can be saturated without any one callback waiting long (each waits behind a few others, and all of them
behind the sum), so the loop thread's CPU time is counted too: its share of the wall between two reads says how busy
the loop was (`busy_share`; time spent waiting for the GIL is not in it). One known holder is counted beside them:
the process's garbage collections (a collection holds the GIL for its whole pass, so it stops the loop and every
other thread), by generation, their number and time (`gc.callbacks`).

A burst lasts a fraction of a second, less than any window between two reads, so the snapshot also holds the last
`RECENT_S` seconds in 100 ms bins (`recent`: each bin's wall time, worst lag and the loop thread's CPU ms in it).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import gc
import time
from dataclasses import dataclass, field

# upper bounds (ms) of the histogram's buckets; a last bucket holds what is later than the last bound
BOUNDS_MS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
BIN_S = 0.1  # the recent series' bins
RECENT_S = 30.0


@dataclass
class LoopLagStats:
    samples: int = 0
    sum_ms: float = 0.0
    max_ms: float = 0.0
    counts: list[int] = field(default_factory=lambda: [0] * (len(BOUNDS_MS) + 1))

    def add(self, lag_ms: float) -> None:
        self.samples += 1
        self.sum_ms += lag_ms
        self.max_ms = max(self.max_ms, lag_ms)
        self.counts[bisect.bisect_left(BOUNDS_MS, lag_ms)] += 1

    def as_dict(self) -> dict:
        return {"samples": self.samples, "sum_ms": round(self.sum_ms, 3), "max_ms": round(self.max_ms, 3),
                "bounds_ms": list(BOUNDS_MS), "counts": list(self.counts)}


def _clock() -> dict:
    """The loop thread's CPU seconds and the wall clock, read together (called on the loop's thread)."""
    return {"cpu_s": round(time.thread_time(), 6), "wall_s": round(time.monotonic(), 6)}


class GcPauses:
    """The process's garbage collections since `start()`: per generation, how many and how long (ms)."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.sum_ms = [0.0, 0.0, 0.0]
        self.max_ms = [0.0, 0.0, 0.0]
        self._began: float | None = None

    def start(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            ms, g = (time.perf_counter() - self._began) * 1000, info["generation"]
            self.count[g] += 1
            self.sum_ms[g] += ms
            self.max_ms[g] = max(self.max_ms[g], ms)
            self._began = None

    def as_dict(self) -> dict:
        return {"count": list(self.count), "sum_ms": [round(x, 3) for x in self.sum_ms],
                "max_ms": [round(x, 3) for x in self.max_ms]}


def window(before: dict | None, after: dict) -> dict:
    """The lag between two snapshots (`LoopLag.snapshot()`; `before=None`: since start): samples, mean, and
    the share of samples later than each bound. The worst is since start (a maximum cannot be subtracted)."""
    before = before or {"samples": 0, "sum_ms": 0.0, "counts": [0] * len(after["counts"])}
    n = after["samples"] - before["samples"]
    counts = [a - b for a, b in zip(after["counts"], before["counts"], strict=True)]
    later, over = {}, n
    for bound, count in zip(after["bounds_ms"], counts, strict=False):
        over -= count
        if bound in (5, 20, 100):
            later[f"over_{bound:g}ms"] = round(over / n, 4) if n else None
    out = {"samples": n, "mean_ms": round((after["sum_ms"] - before["sum_ms"]) / n, 3) if n else None,
           **later, "max_ms_since_start": after["max_ms"]}
    if "clock" in after and "clock" in before:  # the loop thread's CPU time over the wall between the reads
        wall = after["clock"]["wall_s"] - before["clock"]["wall_s"]
        out["busy_share"] = round((after["clock"]["cpu_s"] - before["clock"]["cpu_s"]) / wall, 4) if wall > 0 else None
    if "gc" in after:  # collections between the reads, by generation: how many, their time, the longest since start
        gc_before = before.get("gc", {"count": [0, 0, 0], "sum_ms": [0.0, 0.0, 0.0]})
        out["gc"] = {f"gen{g}": {"count": after["gc"]["count"][g] - gc_before["count"][g],
                                 "sum_ms": round(after["gc"]["sum_ms"][g] - gc_before["sum_ms"][g], 3),
                                 "max_ms_since_start": after["gc"]["max_ms"][g]} for g in range(3)}
    return out


class LoopLag:
    """Samples the running loop's lag (and counts the process's collections) from `start()` until `stop()`.
    Event-loop side only."""

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self._stats = LoopLagStats()
        self._gc = GcPauses()
        self._task: asyncio.Task | None = None
        # (bin start wall time, worst lag ms, loop thread CPU ms) of the last RECENT_S seconds; the current bin apart
        self._recent: collections.deque = collections.deque(maxlen=round(RECENT_S / BIN_S))
        self._bin: list[float] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._gc.start()

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._gc.stop()

    def snapshot(self) -> dict:
        """Cumulative counts; call it on the loop's thread (its `clock` reads that thread's CPU time)."""
        return {**self._stats.as_dict(), "gc": self._gc.as_dict(), "clock": _clock(),
                "recent": {"bin_s": BIN_S, "bins": [[round(t, 2), round(lag, 2), round(cpu, 2)]
                                                    for t, lag, cpu in self._recent]}}

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            lag_ms = max(0.0, loop.time() - asked) * 1000
            self._stats.add(lag_ms)
            self._add_to_bin(lag_ms)

    def _add_to_bin(self, lag_ms: float) -> None:
        now, cpu_ms = time.time(), time.thread_time() * 1000
        start = now - now % BIN_S
        if self._bin is not None and self._bin[0] != start:  # the bin ended: its CPU is up to this sample's
            self._recent.append((self._bin[0], self._bin[1], cpu_ms - self._bin[2]))
            self._bin = None
        if self._bin is None:
            self._bin = [start, lag_ms, cpu_ms]
        else:
            self._bin[1] = max(self._bin[1], lag_ms)
