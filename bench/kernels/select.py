"""Token selection per call, as the step's graphs run it: the compiled `select_tokens` (sort-based) against the
sampling kernel (stages/sampling_kernel.py, top-k by bisection), on the talker's (3072) and the code predictor's
(2048) vocabularies at the default sampling parameters (temperature 0.9, top-k 50, top-p 1.0) and with top-p 0.8.
Each variant is timed as a CUDA graph of back-to-back calls; both must pick the same ids. (A radix-select variant
measured 1.3-1.5x slower than bisection on the H100 and was removed: docs/benchmarks.md.)

    python -m bench.kernels.select [--batches 1,64,256] [--out results.json]    # CUDA only; ~1 min
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from bench.kernels.timing import graph_us
from stages import sampling_kernel
from stages.sampling import SamplingTensors, select_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    compiled = torch.compile(select_tokens, dynamic=True, fullgraph=True)  # as the runner compiles it
    rows = []
    for b, vocab, top_p in itertools.product(map(int, args.batches.split(",")), (2048, 3072), (1.0, 0.8)):
        logits = torch.randn(b, vocab, device="cuda") * 3
        params = SamplingTensors(torch.ones(b, dtype=torch.bool, device="cuda"),
                                 torch.full((b,), 0.9, device="cuda"), torch.full((b,), 50, device="cuda"),
                                 torch.full((b,), top_p, device="cuda"))
        seeds = torch.randint(0, 2**40, (b,), device="cuda")
        counters = torch.randint(0, 2**20, (b,), device="cuda")
        variants = {"compiled_sort": functools.partial(compiled, logits, params, seeds, counters),
                    "kernel_bisection": functools.partial(sampling_kernel.select_tokens, logits, params, seeds, counters)}
        ids = {name: call() for name, call in variants.items()}
        row = {"batch": b, "vocab": vocab, "top_p": top_p,
               "same_ids": {name: int((t == ids["compiled_sort"]).sum()) for name, t in ids.items()},
               "us": {name: round(graph_us([call] * 16), 2) for name, call in variants.items()}}
        rows.append(row)
        print(f"batch {b:3d} vocab {vocab} top_p {top_p}: " + ", ".join(f"{k} {v} us" for k, v in row["us"].items())
              + f"; same ids as sort: {row['same_ids']} of {b}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
