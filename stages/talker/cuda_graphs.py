"""CUDA graphs of the talker runner: the decode step's two halves per (batch bucket, length bucket) and the prefill per
(batch, width), captured into one memory pool, largest batch first (smaller graphs reuse its memory); and the
warm-up that runs the widest of both once before the KV pool is sized (stages/talker/paged_kv.kv_pool_blocks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from stages.cuda_graph import capture_graph
from stages.talker.staging import write_stage

if TYPE_CHECKING:
    from stages.talker.runner import TalkerRunner


@torch.no_grad()
def warm_up(runner: TalkerRunner, batch_buckets: tuple[int, ...]) -> None:
    """The widest decode step and prefill once each, eagerly on scratch state (as capture's own warm-up runs them):
    kernels compiled and autotuned, workspaces allocated, the transient peak of a forward reached and recorded."""
    if runner.cuda:
        torch.cuda.reset_peak_memory_stats(runner.device)  # the peak from here on: serving's, not loading's
    saved = [t.clone() for t in runner._row_tensors()]
    b = max(batch_buckets)
    runner.positions[:b] = 0
    runner._decode_step(b, max(runner.length_buckets))
    host = runner._host_stage.buffers[0]  # a blocking copy below: no event needed
    # the largest prefill that runs: the widest (batch x width) graph, or one prompt of 16 without widths
    nb, width = max(runner.prefill_keys(), key=lambda k: (k[0] * k[1], k[1]), default=(1, 16))
    write_stage(host, [], nb, width, runner.trailing_width, runner.scratch_row, runner.kv.scratch_block)
    runner._stage.buf.copy_(host.buf)
    runner._prefill_compute(nb, width, runner.trailing_width)
    for t, s in zip(runner._row_tensors(), saved, strict=True):
        t.copy_(s)
    if runner.cuda:
        torch.cuda.synchronize(runner.device)


@torch.no_grad()
def capture(runner: TalkerRunner, batch_buckets: tuple[int, ...], log: Callable[[str], None] = print) -> float:
    """Capture the decode step's halves per (batch bucket, length bucket) and the prefill per (batch, width).

    Capture runs on scratch state: row contents are saved and restored around it. Returns seconds taken.
    """
    if not runner.cuda:
        return 0.0
    t0 = time.perf_counter()
    saved = [t.clone() for t in runner._row_tensors()]
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(runner.device)

    def capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        return capture_graph(fn, pool, stream)[0]

    log(f"[talker] capturing CUDA graphs for batch buckets {tuple(sorted(batch_buckets))} x length buckets "
        f"{runner.length_buckets}")
    keys = [(b, L) for b in sorted(batch_buckets, reverse=True) for L in runner.length_buckets]
    for i, (b, attn_len) in enumerate(keys):
        runner.positions[:b] = 0
        runner.graphs[(b, attn_len)] = (capture(lambda b=b: runner._frame_codes_step(b)),
                                         capture(lambda b=b, L=attn_len: runner._talker_step(b, L)))
        if (i + 1) % max(1, len(keys) // 10) == 0 or i + 1 == len(keys):
            log(f"[talker] captured {i + 1}/{len(keys)} decode graphs ({time.perf_counter() - t0:.1f} s)")
    # prefill graphs read the device staging rows: fill them with padding (the scratch row) for capture
    host = runner._host_stage.buffers[0]  # a blocking copy below: no event needed
    write_stage(host, [], runner.max_prefill_batch, max(runner.prefill_width_buckets, default=16), runner.trailing_width,
                runner.scratch_row, runner.kv.scratch_block)
    runner._stage.buf.copy_(host.buf)
    prefill_keys = runner.prefill_keys()
    for b, w in prefill_keys:  # none without widths (prompts longer than every width): prefill runs eagerly
        runner.prefill_graphs[(b, w)] = capture(lambda b=b, w=w: runner._prefill_compute(b, w, runner.trailing_width))
    log(f"[talker] captured {len(prefill_keys)} prefill graphs ({time.perf_counter() - t0:.1f} s)")
    for t, s in zip(runner._row_tensors(), saved, strict=True):
        t.copy_(s)
    torch.cuda.synchronize(runner.device)
    seconds = time.perf_counter() - t0
    log(f"[talker] graph capture took {seconds:.1f} s")
    return seconds
