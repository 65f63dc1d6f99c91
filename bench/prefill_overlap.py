"""Could a prefill hide under a decode step? On the GPU: a decode step of B rows, a prefill of n prompts, one after
the other on one stream (what the engine does today: a prefill between two steps), and the two at once, the step
on a high-priority stream and the prefill on a second stream (its CUDA graph captured into a memory pool of its
own, so the two replays share no memory). Per iteration ms of each.

And what folding the prompts into the step could cost at best (mixed prefill/decode: one pass over the weights for
the step's rows and the prompts' tokens): the talker layers' GEMMs (every `nn.Linear` of its 28 layers as separate
products, where the engine fuses q/k/v and gate/up; one CUDA graph) over B rows and over B + the prompts' real
tokens; `dense_increment_ms` is their difference, against `prefill_ms`. Attention, the prompts' embedding and their
first codebook-0 token are left out: a lower bound of the mixed step's extra time, to decide whether building one
can pay.

    python -m bench.prefill_overlap --checkpoint DIR --batch 64 --prompts 4,8 --iters 50

H100, 2026-11-24 (docs/benchmarks.md "Packed prefill", its paragraph "A prefill beside the step"): the second
stream hid 16-21% of a prefill's time. With 16 prompts the concurrent replay ended in "an illegal instruction was
encountered" (not investigated: the design it probed was dropped on the smaller figures); run 16 alone with care.

The prompts are the load generator's sentences (bench/loadgen/sentences.txt) with a CustomVoice speaker; the step's
rows hold the same prompts. The prefill's rows are B..B+n-1, outside the step's, so the two never touch the same row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from bench.gpu_timing import timed
from bench.talker_setup import talker_and_plans
from stages.contract import SamplingParams
from stages.talker.runner import Admission, TalkerRunner


def dense_chain_ms(backbone: torch.nn.Module, rows: int, iters: int) -> float:
    """ms per replay of a CUDA graph running every `nn.Linear` of `backbone` on `rows` rows (their GEMMs alone)."""
    linears = [m for m in backbone.modules() if isinstance(m, torch.nn.Linear)]
    weight = linears[0].weight
    x = torch.randn(rows, max(m.in_features for m in linears), device=weight.device, dtype=weight.dtype)

    def chain() -> None:
        for m in linears:
            torch.nn.functional.linear(x[:, :m.in_features], m.weight, m.bias)

    chain()  # warm: cuBLAS picks its kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    timed(graph.replay, 3)
    return timed(graph.replay, iters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: a random 1.7B CustomVoice under --workdir)")
    ap.add_argument("--workdir", default="/tmp/qwen3-tts-bench")
    ap.add_argument("--batch", type=int, default=64, help="rows of the decode step")
    ap.add_argument("--prompts", default="4,8", help="prompts in the prefill, comma list (one measurement each)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    model, plans = talker_and_plans(args.checkpoint, args.workdir)
    b, counts = args.batch, [int(x) for x in args.prompts.split(",")]
    per_request = 1024 // 16
    runner = TalkerRunner(model, b + max(counts), 1024, 256, num_blocks=(b + max(counts)) * per_request, compile=True)
    runner.capture_graphs((b,), log=print)
    sampling = SamplingParams(suppress_eos=True)

    def admissions(rows: range) -> list[Admission]:
        return [Admission(r, plans[r % len(plans)], sampling, r, np.arange(r * per_request, (r + 1) * per_request))
                for r in rows]

    for start in range(0, b, runner.max_prefill_batch):
        runner.admit(admissions(range(start, min(b, start + runner.max_prefill_batch))))
    attn_len = runner.attn_bucket(1000)
    high = torch.cuda.Stream(priority=-1)
    side = torch.cuda.Stream()
    joined = torch.cuda.Event()
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "batch": b, "iters": args.iters, "runs": []}
    for n in counts:
        batch = admissions(range(b, b + n))
        runner.admit(batch)  # stages the prefill's batch on the device (and runs it once)
        torch.cuda.synchronize()
        print(f"prefill of {n} staged", flush=True)
        key = runner.prefill_bucket(n, max(a.plan.length for a in batch))
        assert key is not None, "no graphed bucket for this prefill"
        nb, w = key
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up, then capture into a pool of its own
            runner._prefill_compute(nb, w, runner.trailing_width)
        torch.cuda.current_stream().wait_stream(side)
        prefill = torch.cuda.CUDAGraph()
        with torch.cuda.graph(prefill, pool=torch.cuda.graph_pool_handle()):
            runner._prefill_compute(nb, w, runner.trailing_width)
        torch.cuda.synchronize()
        print(f"prefill of {n} captured", flush=True)

        def step() -> None:
            runner.launch_step(b, attn_len)

        def sequential(prefill=prefill) -> None:  # the engine today: a prefill between two steps, one stream
            runner.launch_step(b, attn_len)
            prefill.replay()

        def concurrent(prefill=prefill) -> None:  # the step on the high-priority stream, the prefill beside it
            side.wait_stream(high)  # after the step before: its rows' blocks may be a new request's
            with torch.cuda.stream(high):
                runner.launch_step(b, attn_len)
            with torch.cuda.stream(side):
                prefill.replay()
                joined.record()
            high.wait_event(joined)

        for run in (step, sequential, concurrent):
            timed(run, 3)  # warm
            print(f"{run.__name__} ran", flush=True)
        row = {"prompts": n, "prefill_bucket": [nb, w], "step_ms": timed(step, args.iters),
               "prefill_ms": timed(prefill.replay, args.iters), "sequential_ms": timed(sequential, args.iters),
               "concurrent_ms": timed(concurrent, args.iters)}
        row["hidden_share"] = (row["sequential_ms"] - row["concurrent_ms"]) / row["prefill_ms"]
        tokens = sum(a.plan.length for a in batch)
        row["prompt_tokens"] = tokens
        row["dense_step_rows_ms"] = dense_chain_ms(runner.talker.model, b, args.iters)
        row["dense_step_and_prompt_rows_ms"] = dense_chain_ms(runner.talker.model, b + tokens, args.iters)
        row["dense_increment_ms"] = row["dense_step_and_prompt_rows_ms"] - row["dense_step_rows_ms"]
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
