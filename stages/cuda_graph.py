"""capture_graph: one CUDA graph of a function, captured after warm-up runs on a side stream.

The warm-up runs settle what must not happen inside a capture (kernel loading, cuBLAS/cuDNN plans, the caching
allocator's first blocks). Every engine that replays graphs captures through this: the Talker's decode and prefill
steps, Code2Wav's decoder, the aligner's transformers.

Captures are thread-local (CUDA's `cudaStreamCaptureModeThreadLocal`): only the capturing thread is barred from the
calls that would break its capture. Another thread of the process may run device work meanwhile, on its own streams
(never the capture's side stream): the Talker's first-chunk decoder is built while the replica's engine already
serves (deployments/talker/first_chunk_decoder.py), and the engine's syncs and allocations must not fail that build,
nor the build's capture fail the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture_graph(fn: Callable[[], T], pool, stream: torch.cuda.Stream, free_cached: bool = False,
                  warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, T]:
    """-> (the graph, what `fn` returned while captured: the graph's static outputs). `pool`: the memory pool the
    graph shares with the others of its engine; `stream`: the side stream of the warm-up runs; `free_cached`:
    return the warm-up's cached blocks before capturing, so that they do not sit beside the pool; `warmups`: side-stream
    runs before the capture."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    current.wait_stream(stream)
    if free_cached:
        torch.cuda.empty_cache()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return graph, out
