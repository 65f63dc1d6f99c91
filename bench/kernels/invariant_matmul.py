"""The batch-invariant GEMM (stages/invariant_matmul.py) against cuBLAS on the 1.7B Talker's and code predictor's
products, bf16, at decode and prefill row counts.

Per (product, rows): microseconds per call of cuBLAS (torch.mm) and of the invariant kernel, each timed as a CUDA
graph of `--calls` back-to-back calls cycling weight copies that together exceed the L2 cache (as a step's weights
do), CUDA events around each of `--reps` replays, the median; max error of both against an fp32 reference. Per
product: whether the rows of products of every row count, at several positions, are bit-identical to the same rows
of one `max(rows)`-row product (and the same for cuBLAS, for contrast). Then, with `enable()`, a torch.compile'd
F.linear (dynamic shapes) and a CUDA-graph replay of it: do they take the invariant kernel (rows bit-equal to the
kernel's eager result at every row count)? `--sweep` also times alternative tile configurations per product (the
sum over `--sweep-rows` of the time) against `tiles()`'s choice.

    python -m bench.kernels.invariant_matmul [--rows 1,2,8,64,256,512,2048] [--sweep] [--out FILE]   # CUDA only

Prints one JSON: {"products": [{"shape", "n", "k", "rows", "cublas_us", "invariant_us", "ratio", "err_invariant",
"err_cublas"}], "invariance": {shape: {"invariant": true, "cublas": false}}, "compiled": {...}, "sweep": {...}}.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F

from bench.kernels.timing import L2_BYTES, graph_us
from stages import invariant_matmul as im

# (name, N, K, bias) of the 1.7B model's products: talker hidden 2048 / MLP 6144 (q/k/v and gate/up stacked), codec
# head 3072, text projection 2048 -> 2048 -> 2048; code predictor 1024 / 3072, its input projection 2048 -> 1024 and
# its 15 heads of 2048 codes
SHAPES = (
    ("talker.qkv", 4096, 2048, False), ("talker.o", 2048, 2048, False), ("talker.gate_up", 12288, 2048, False),
    ("talker.down", 2048, 6144, False), ("talker.codec_head", 3072, 2048, False), ("text_proj", 2048, 2048, True),
    ("cp.input_proj", 1024, 2048, True), ("cp.qkv", 4096, 1024, False), ("cp.o", 1024, 2048, False),
    ("cp.gate_up", 6144, 1024, False), ("cp.down", 1024, 3072, False), ("cp.head", 2048, 1024, False),
)


def product_fn(kind: str, x: torch.Tensor, bias: torch.Tensor | None, config: im.Tiles | None = None):
    def call(w: torch.Tensor) -> torch.Tensor:
        if kind == "cublas":
            return F.linear(x, w, bias)
        return im.addmm(bias, x, w.t(), config=config) if bias is not None else im.mm(x, w.t(), config=config)
    return call


def timings(name, n, k, has_bias, rows, args) -> tuple[list, dict]:
    copies = max(2, min(args.calls, -(-2 * L2_BYTES // (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    top = max(rows)
    x_all = torch.randn(top, k, device="cuda", dtype=torch.bfloat16)
    w = weights[0]
    out = []
    for m in rows:
        x = x_all[:m]
        ref = F.linear(x.float(), w.float(), bias.float() if has_bias else None)
        scale = ref.abs().max().item()
        row = {"shape": name, "n": n, "k": k, "rows": m}
        for kind in ("cublas", "invariant"):
            fn = product_fn(kind, x, bias)
            calls = [functools.partial(fn, weights[i % copies]) for i in range(args.calls)]
            row[f"{kind}_us"] = round(graph_us(calls, args.reps), 2)
            row[f"err_{kind}"] = (fn(w).float() - ref).abs().max().item() / scale
        row["ratio"] = round(row["invariant_us"] / row["cublas_us"], 2)
        out.append(row)
        print(json.dumps(row), flush=True)
    same = {}
    for kind in ("invariant", "cublas"):
        full = product_fn(kind, x_all, bias)(w)
        same[kind] = all(torch.equal(product_fn(kind, x_all[s:s + m], bias)(w), full[s:s + m])
                         for m in rows for s in {0, (top - m) // 2, top - m})
    return out, same


def sweep(name, n, k, has_bias, rows, args) -> dict:
    """Sum over `rows` of the time per call, per candidate tile configuration; the best and `tiles()`'s."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(4)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows}
    default = im.tiles(n, k, torch.bfloat16)
    results = {}
    for bm, bn, bk, stages in itertools.product((64, 128), (16, 32, 64, 128), (64, 128), (3, 4)):
        cfg = im.Tiles(bm, bn, bk, 8, 4 if bm == 64 else 8, stages)
        try:
            total = sum(graph_us([functools.partial(product_fn("invariant", xs[m], bias, cfg), weights[i % 4])
                                  for i in range(16)], max(5, args.reps // 4)) for m in rows)
        except Exception as e:  # a configuration Triton cannot build or launch (shared memory)
            print(f"{name} {cfg}: {type(e).__name__}: {e}"[:200], flush=True)
            continue
        results[f"{bm}x{bn}x{bk} w{cfg.num_warps} s{stages}"] = round(total, 2)
    best = min(results, key=results.get)
    key = f"{default.block_m}x{default.block_n}x{default.block_k} w{default.num_warps} s{default.num_stages}"
    return {"best": best, "best_us": results[best], "default": key, "default_us": results.get(key), "all": results}


def compiled_check(rows: list[int]) -> dict:
    """With enable(): a torch.compile'd F.linear (dynamic shapes, with bias) and a CUDA-graph replay of it give,
    at every row count, rows bit-equal to the invariant kernel's eager result. After disable(), the same compiled
    function's rows across row counts (cuBLAS) for contrast."""
    n, k = 2048, 2048
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
    linear = torch.compile(lambda x_: F.linear(x_, w, bias), dynamic=True, fullgraph=True)
    ref = im.addmm(bias, x, w.t())
    result = {}
    with im.invariant_matmul():
        result["compiled_equals_kernel"] = all(torch.equal(linear(x[:m]), ref[:m]) for m in rows)
        static = x[:64].clone()
        linear(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(static)
        static.copy_(x[-64:])
        graph.replay()
        result["graph_replay_equals_kernel"] = torch.equal(out, ref[-64:])
    full = linear(x)  # the same compiled code, now on aten's kernels again
    result["cublas_rows_identical_across_rows"] = all(torch.equal(linear(x[:m]), full[:m]) for m in rows)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,8,64,256,512,2048")
    ap.add_argument("--shapes", default="", help="comma-separated product names (default: all)")
    ap.add_argument("--calls", type=int, default=16, help="calls per graph (weight copies cycled)")
    ap.add_argument("--reps", type=int, default=50, help="graph replays timed (the median is reported)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configurations")
    ap.add_argument("--sweep-rows", default="1,64,256,2048")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(",")) if args.shapes else None
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "products": [], "invariance": {},
              "sweep": {}}
    for name, n, k, has_bias in SHAPES:
        if wanted and name not in wanted:
            continue
        products, same = timings(name, n, k, has_bias, rows, args)
        report["products"] += products
        report["invariance"][name] = same
        if args.sweep:
            report["sweep"][name] = sweep(name, n, k, has_bias, [int(r) for r in args.sweep_rows.split(",")], args)
            print(json.dumps({name: {key: v for key, v in report["sweep"][name].items() if key != "all"}}), flush=True)
    report["compiled"] = compiled_check(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
