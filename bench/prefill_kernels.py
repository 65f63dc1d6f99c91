"""Where a prefill's device time goes, kernel by kernel: the talker's prefill of n prompts (compiled layers, run
eagerly so that the profiler sees each kernel; the engine replays the same kernels as one CUDA graph) under the
torch profiler, its kernels grouped by name with their count and device time, and the graph's replay time beside.

    python -m bench.prefill_kernels --prompts 4 --top 25

H100, 2026-11-24 (docs/benchmarks.md "Mixed prefill/decode"): a prefill of 4 prompts took 3.5 ms between two steps
where the layers' products over its positions take ~0.5 ms more than over none; this says what the rest is.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_timing import kernel_groups, timed
from bench.talker_setup import talker_and_plans
from stages.contract import SamplingParams
from stages.talker.runner import Admission, TalkerRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: a random 1.7B CustomVoice under --workdir)")
    ap.add_argument("--workdir", default="/tmp/qwen3-tts-bench")
    ap.add_argument("--prompts", type=int, default=4, help="prompts in the prefill")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--top", type=int, default=25, help="kernel groups to print")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    model, plans = talker_and_plans(args.checkpoint, args.workdir)
    n, per_request = args.prompts, 1024 // 16
    runner = TalkerRunner(model, n, 1024, 256, num_blocks=n * per_request, compile=True)
    runner.capture_graphs((1,), log=print)
    batch = [Admission(r, plans[r], SamplingParams(suppress_eos=True), r, np.arange(r * per_request, (r + 1) * per_request))
             for r in range(n)]
    runner.admit(batch)  # stages the batch on the device (and runs its graph once)
    key = runner.prefill_bucket(n, max(a.plan.length for a in batch))
    assert key is not None and key in runner.prefill_graphs, "no graphed bucket for this prefill"
    nb, w = key
    graph = runner.prefill_graphs[key]

    def eager() -> None:
        runner._prefill_compute(nb, w, runner.trailing_width)

    for run in (eager, graph.replay):
        run()
    replay_ms = timed(graph.replay, args.iters)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            eager()
        torch.cuda.synchronize()
    rows = kernel_groups(prof, args.iters)
    total = sum(r[2] for r in rows)
    kernels = sum(r[1] for r in rows)
    print(f"prefill of {n} prompts, bucket {key}, {sum(a.plan.length for a in batch)} positions: graph replay "
          f"{replay_ms:.2f} ms; eager under the profiler {kernels:.0f} kernels, {total:.2f} ms of device time")
    print("| kernel | per prefill | ms |\n|---|---:|---:|")
    for name, count, ms in rows[:args.top]:
        print(f"| {name} | {count:.0f} | {ms:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "prompts": n, "bucket": list(key), "graph_replay_ms": replay_ms, "kernels": kernels, "device_ms": total,
            "groups": [{"kernel": r[0], "per_prefill": r[1], "ms": r[2]} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
