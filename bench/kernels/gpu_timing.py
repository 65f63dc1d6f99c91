"""What GPU micro-benchmarks share: the per-call timer and the profiler's kernels grouped by name (the one-off
kernel profiles that used them are in git history, commit d53be6e: docs/benchmarks.md, 2026-11-28)."""

from __future__ import annotations

import time
from collections import defaultdict

import torch


def timed(run, iters: int) -> float:
    """ms per call of `run` (launches only; the device is drained before and after)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def kernel_groups(prof, iters: int, skip_prefix: str | None = None) -> list[tuple[str, float, float]]:
    """The profile's kernels grouped by name (first 90 characters): (name, count, ms) per call of the profiled
    `iters` calls, largest first. `skip_prefix`: events to leave out (e.g. `record_function` ranges, which show
    on the device timeline as events of their own)."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not (skip_prefix and e.name.startswith(skip_prefix)):
            g = groups[e.name[:90]]
            g[0] += 1
            g[1] += e.device_time_total / 1e3
    return sorted(((name, c / iters, ms / iters) for name, (c, ms) in groups.items()), key=lambda r: -r[2])
