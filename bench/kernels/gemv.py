"""The decoder layer's four products at a few rows: cuBLAS (what the compiled layers run) against the Triton GEMVs
of stages/gemv_kernels.py, per tiling, on the 1.7B talker's and code predictor's shapes.

Each variant is timed as a CUDA graph of `--calls` back-to-back calls, each on its own copy of the weight (the
copies together exceed the L2 cache, as a step's weights do), so a call costs what it costs inside the step's
graph: kernel time plus the boundary to the next kernel. The cuBLAS row is the product alone (the compiled
layer's norm, SwiGLU and residual are further kernels; the Triton rows include them).

    python -m bench.kernels.gemv [--rows 1,4] [--warps 4,8] [--out results.json]    # CUDA only; ~3 min per row count
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F

from bench.kernels.timing import L2_BYTES, graph_us
from stages import gemv_kernels

# (name, N, K, flags) of the 1.7B layers: talker hidden 2048 / MLP 6144, code predictor 1024 / 3072, q/k/v 4096 rows
SHAPES = (
    ("talker.qkv", 4096, 2048, "norm"), ("talker.o", 2048, 2048, "residual"),
    ("talker.gate_up", 6144, 2048, "norm,swiglu"), ("talker.down", 2048, 6144, "residual"),
    ("cp.qkv", 4096, 1024, "norm"), ("cp.o", 1024, 2048, "residual"),
    ("cp.gate_up", 3072, 1024, "norm,swiglu"), ("cp.down", 1024, 3072, "residual"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1", help="row counts (each tiling compiles once per row count: ~1 s)")
    ap.add_argument("--warps", default="4,8", help="num_warps values swept (each tiling compiles once per value)")
    ap.add_argument("--calls", type=int, default=24, help="calls per graph (weight copies cycled)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dt = torch.bfloat16
    results = []
    for (name, n, k, flags), m in itertools.product(SHAPES, map(int, args.rows.split(","))):
        swiglu, norm, residual = "swiglu" in flags, "norm" in flags, "residual" in flags
        rows_w = 2 * n if swiglu else n
        copies = max(2, min(args.calls, -(-2 * L2_BYTES // (rows_w * k * 2))))
        weights = [torch.randn(rows_w, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(copies)]
        x = torch.randn(m, k, device="cuda", dtype=dt)
        norm_w = (torch.rand(k, device="cuda", dtype=dt) + 0.5, 1e-6) if norm else None
        res = torch.randn(m, n, device="cuda", dtype=dt) if residual else None
        calls = [weights[i % copies] for i in range(args.calls)]
        cublas = graph_us([functools.partial(F.linear, x, w) for w in calls])
        nbytes = rows_w * k * 2
        ref = gemv_kernels.gemv(x, weights[0], norm_w, swiglu, res)
        row = {"shape": name, "rows": m, "n": n, "k": k, "flags": flags, "weight_mb": round(nbytes / 2**20, 1),
               "cublas_us": round(cublas, 2), "cublas_tb_s": round(nbytes / cublas / 1e6, 2), "tilings": []}
        default = gemv_kernels.tiling(m, n, k, swiglu)
        rows_p = 1 << (m - 1).bit_length()
        for bn, bk, warps in itertools.product((2, 4, 8, 16, 32), (128, 256, 512, 1024, 2048),
                                               map(int, args.warps.split(","))):
            tile = rows_p * bn * bk * (2 if swiglu else 1)
            if not 1024 <= tile <= 16384 or bk > k:
                continue  # tiny tiles; tiles past what a program holds in registers (the first sweep, 2026-11-23,
                # was fastest at its largest BLOCK_K, 512: this one goes on to whole rows)
            blocks = (bn, bk, warps)
            try:
                out = gemv_kernels.gemv(x, weights[0], norm_w, swiglu, res, blocks=blocks)
                diff = (out.float() - ref.float()).abs().max().item()
                us = graph_us([functools.partial(gemv_kernels.gemv, x, w, norm_w, swiglu, res, blocks=blocks)
                               for w in calls])
            except Exception as e:  # a tiling Triton cannot build
                print(f"{name} m={m} {blocks}: {type(e).__name__}: {e}"[:200])
                continue
            row["tilings"].append({"block_n": bn, "block_k": bk, "warps": warps, "us": round(us, 2),
                                   "tb_s": round(nbytes / us / 1e6, 2), "max_diff": diff, "default": blocks == default})
        best = min(row["tilings"], key=lambda t: t["us"])
        dflt = next((t for t in row["tilings"] if t["default"]), None)
        row["best"], row["default"] = best, dflt
        results.append(row)
        print(f"{name:15s} m={m} {row['weight_mb']:5.1f} MB  cublas {cublas:6.2f} us ({row['cublas_tb_s']:.2f} TB/s)  "
              f"triton best {best['us']:6.2f} us ({best['tb_s']:.2f} TB/s) at {best['block_n']}x{best['block_k']} "
              f"w{best['warps']}  default {dflt and dflt['us']} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
