"""Timing shared by the kernel benches: a kernel's calls captured back to back in one CUDA graph."""

from __future__ import annotations

import statistics

import torch

L2_BYTES = 50 << 20  # an H100/H200's L2: benches cycle weight copies larger than it, as a step's weights are


def graph_us(calls: list, reps: int = 20) -> float:
    """Median microseconds per call: `calls` captured back to back in one CUDA graph, each of `reps` replays timed
    with CUDA events (two eager runs of the first calls warm them up: compiles, autotuning)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:2]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)
