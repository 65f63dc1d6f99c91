"""LoopLag (deployments/loop_lag.py): a blocked event loop shows as lag, counted in the right bucket; windows subtract."""

from __future__ import annotations

import asyncio
import gc
import time

from bench.replica_stats import lag_between
from deployments import loop_lag
from deployments.loop_lag import LoopLag


async def _samples_past(lag: LoopLag, n: int) -> None:
    while lag.snapshot()["samples"] <= n:
        await asyncio.sleep(0)


async def _around(hold) -> tuple[dict, dict]:
    """Snapshots of a sampling LoopLag just before `hold()` runs on its loop and after the next sample."""
    lag = LoopLag(interval_s=0.001)
    lag.start()
    await _samples_past(lag, 0)
    before = lag.snapshot()
    hold()
    await _samples_past(lag, before["samples"])
    after = lag.snapshot()
    lag.stop()
    return before, after


def test_a_blocked_loop_is_measured_as_lag():
    before, after = asyncio.run(_around(lambda: time.sleep(0.06)))  # holds the loop, as a burst of work would
    # the sample taken across the block woke at least the block's length minus one interval late
    assert after["max_ms"] >= 59
    late = [c - b for c, b in zip(after["counts"], before["counts"], strict=True)]
    assert sum(late[loop_lag.BOUNDS_MS.index(50) + 1:]) >= 1, "the blocked sample is not in a bucket above 50 ms"
    w = loop_lag.window(before, after)
    assert w["samples"] == after["samples"] - before["samples"] >= 1
    assert w["over_20ms"] > 0 and w["mean_ms"] >= 59 / w["samples"]
    # time.sleep holds the loop without using its CPU: busy is CPU time over wall, in [0, 1]
    assert 0 <= w["busy_share"] <= 1


def test_a_loop_busy_computing_shows_as_busy():
    async def run() -> dict:
        lag = LoopLag(interval_s=0.001)
        lag.start()
        await _samples_past(lag, 0)
        before = lag.snapshot()
        spin_until = time.thread_time() + 0.2
        while time.thread_time() < spin_until:  # 200 ms of this thread's CPU, in 1 ms slices
            t = time.thread_time() + 0.001
            while time.thread_time() < t:
                pass
            await asyncio.sleep(0)
        after = lag.snapshot()
        lag.stop()
        return loop_lag.window(before, after), after["recent"], after["clock"]["cpu_s"] - before["clock"]["cpu_s"]

    w, recent, cpu_s = asyncio.run(run())
    # the loop thread's own CPU is counted whatever else the machine runs; the wall it is divided by is not certain
    # on a loaded machine, so the share is only bounded
    assert cpu_s >= 0.19 and 0 < w["busy_share"] <= 1.05, (cpu_s, w)
    # the 100 ms bins that ended hold most of the 200 ms of CPU (the current bin is not in them yet)
    assert recent["bin_s"] == loop_lag.BIN_S and sum(cpu for _t, _lag, cpu in recent["bins"]) > 50, recent


def test_windows_subtract_and_name_each_replica():
    bounds = list(loop_lag.BOUNDS_MS)
    zero = {"samples": 0, "sum_ms": 0.0, "max_ms": 0.0, "bounds_ms": bounds, "counts": [0] * (len(bounds) + 1)}
    stats = loop_lag.LoopLagStats()
    for ms in (0.5, 0.5, 3.0, 150.0):
        stats.add(ms)
    first = stats.as_dict()
    stats.add(30.0)
    second = stats.as_dict()
    w = loop_lag.window(first, second)
    assert w == {"samples": 1, "mean_ms": 30.0, "over_5ms": 1.0, "over_20ms": 1.0, "over_100ms": 0.0,
                 "max_ms_since_start": 150.0}
    since_start = loop_lag.window(None, first)
    assert since_start["samples"] == 4 and since_start["over_5ms"] == 0.25 and since_start["over_100ms"] == 0.25
    report = lag_between({"event_loop_lag": {"ingress": {"a": first}}},
                         {"event_loop_lag": {"ingress": {"a": second, "b": zero}, "talker": {"t": first}}})
    assert report["ingress"]["a"]["samples"] == 1
    assert report["ingress"]["b"]["samples"] == 0 and report["ingress"]["b"]["mean_ms"] is None
    assert report["talker"]["t"]["samples"] == 4  # absent before: since its start


def test_collections_are_counted_by_generation_and_windowed():
    before, after = asyncio.run(_around(gc.collect))  # a full collection: generation 2
    assert after["gc"]["count"][2] >= before["gc"]["count"][2] + 1
    w = loop_lag.window(before, after)["gc"]
    assert w["gen2"]["count"] >= 1 and w["gen2"]["sum_ms"] > 0 and w["gen2"]["max_ms_since_start"] > 0
    assert loop_lag.window(None, after)["gc"]["gen2"]["count"] == after["gc"]["count"][2]
