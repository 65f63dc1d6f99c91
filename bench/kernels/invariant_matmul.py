"""The batch-invariant GEMM (stages/invariant_matmul.py) against cuBLAS on the 1.7B Talker's and code predictor's
products, bf16, at decode and prefill row counts.

Per (product, rows): microseconds per call of cuBLAS (torch.mm) and of the invariant kernel, each timed as a CUDA
graph of `--calls` back-to-back calls cycling weight copies that together exceed the L2 cache (as a step's weights
do), CUDA events around each of `--reps` replays, the median; max error of both against an fp32 reference. Per
product: whether the rows of products of every row count, at several positions, are bit-identical to the same rows
of one `max(rows)`-row product (and the same for cuBLAS, for contrast). Then, with `enable()`, a torch.compile'd
F.linear (dynamic shapes) and a CUDA-graph replay of it: do they take the invariant kernel (rows bit-equal to the
kernel's eager result at every row count)? `--sweep` also times, per product, the candidate configurations of
`candidates` (tiles by width, each plain, with TMA loads, persistent and both; split-K for the narrower products:
stages/invariant_matmul_variants.py), the sum over `--sweep-rows` of the time, against `tiles()`'s choice; those
whose rows are not bit-identical across row counts, or whose error is off, are rejected. `--tiles-table` prints
the best per (N, K) as Python for `tiles()`.

    python -m bench.kernels.invariant_matmul [--rows 1,2,8,64,256,512,2048] [--sweep [--sweep-rows 64,256,512]
        [--tiles-table]] [--out FILE]   # CUDA only

Prints one JSON: {"products": [{"shape", "n", "k", "rows", "cublas_us", "invariant_us", "ratio", "err_invariant",
"err_cublas"}], "invariance": {shape: {"invariant": true, "cublas": false}}, "compiled": {...}, "sweep": {...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

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


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) the sweep tries, by product width: wide products are compute-bound
# at 256+ rows (big tiles, two warpgroups), narrow ones have few column tiles (narrow tiles, split-K)
WIDE_TILES = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 64, 64, 8, 4),
              (64, 128, 64, 4, 4))
MID_TILES = ((128, 64, 64, 8, 4), (64, 64, 128, 4, 3), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4))
NARROW_TILES = ((64, 32, 128, 4, 3), (64, 32, 64, 4, 4), (64, 64, 128, 4, 3), (128, 32, 64, 4, 4))
SPLITS = (2, 4)
SPLIT_MAX_N = 6144  # split-K candidates only below this width: wider products have enough tiles at decode


def candidates(n: int, k: int) -> list[im.Tiles]:
    """The bf16 configurations the sweep times for an [M, K] x [K, N] product: `tiles()`'s choice first, then each
    tile of the width's list plain, with TMA, persistent and both; below SPLIT_MAX_N also `tiles()`'s choice and
    the first narrower-or-equal alternative with split-K 2 and 4, with and without TMA."""
    default = im.tiles(n, k, torch.bfloat16)
    widths = WIDE_TILES if n >= 8192 else MID_TILES if n >= 2048 else NARROW_TILES
    plain = [default] + [t for t in (im.Tiles(bm, bn, bk, 8, w, s) for bm, bn, bk, w, s in widths) if t != default]
    out = [dataclasses.replace(t, tma=tma, persistent=persistent)
           for t in plain for tma in (False, True) for persistent in (False, True)]
    if n <= SPLIT_MAX_N:
        out += [dataclasses.replace(t, tma=tma, split_k=split)
                for t in plain[:2] for split in SPLITS for tma in (False, True)]
    return out


def label(cfg: im.Tiles) -> str:
    flags = ("tma" if cfg.tma else "") + (" persistent" if cfg.persistent else "") + \
        (f" split{cfg.split_k}" if cfg.split_k > 1 else "")
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{' ' if flags else ''}" \
        f"{flags.strip()}"


def source(cfg: im.Tiles) -> str:
    """`cfg` as the Python expression to paste into `tiles()`: positional tiles, keywords only where not default."""
    extra = "".join(f", {f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)[6:]
                    if getattr(cfg, f.name) != f.default)
    return f"Tiles({cfg.block_m}, {cfg.block_n}, {cfg.block_k}, {cfg.group_m}, {cfg.num_warps}, {cfg.num_stages}{extra})"


def sweep(name, n, k, has_bias, rows, args) -> dict:
    """Sum over `rows` of the time per call, per candidate (`candidates`); the best and `tiles()`'s. A candidate
    counts only if its rows are bit-identical across row counts (each smaller product's rows against the same rows
    of the largest) and its error against an fp32 reference is within 4x cuBLAS's; `same_as_pointer_loads` lists
    the TMA candidates whose results equal (bit for bit) the same configuration's pointer-load kernel."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(4)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    x_all = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
    xs = {m: x_all[:m] for m in rows}
    w = weights[0]
    ref = F.linear(x_all.float(), w.float(), bias.float() if has_bias else None)
    tolerance = 4 * (F.linear(x_all, w, bias).float() - ref).abs().max().item()
    default = im.tiles(n, k, torch.bfloat16)
    results, rejected, results_out, same_as_pointer = {}, {}, {}, {}
    for cfg in candidates(n, k):
        key = label(cfg)
        try:
            full = product_fn("invariant", x_all, bias, cfg)(w)
            err = (full.float() - ref).abs().max().item()
            invariant = all(torch.equal(product_fn("invariant", xs[m], bias, cfg)(w), full[:m]) for m in rows)
            if not invariant or err > tolerance:
                rejected[key] = {"invariant": invariant, "err": err, "tolerance": tolerance}
                continue
            if cfg.tma:
                pointer = product_fn("invariant", x_all, bias, dataclasses.replace(cfg, tma=False))(w)
                same_as_pointer[key] = torch.equal(full, pointer)
            total = sum(graph_us([functools.partial(product_fn("invariant", xs[m], bias, cfg), weights[i % 4])
                                  for i in range(16)], max(5, args.reps // 4)) for m in rows)
        except Exception as e:  # a configuration Triton cannot build or launch (shared memory)
            rejected[key] = f"{type(e).__name__}: {e}"[:200]
            continue
        results[key] = round(total, 2)
        results_out[key] = cfg
    if not results:
        return {"best": None, "best_us": None, "default": label(default), "all": {}, "rejected": rejected,
                "same_as_pointer_loads": same_as_pointer, "_configs": {}}
    best = min(results, key=results.get)
    return {"best": best, "best_us": results[best], "best_tiles": source(results_out[best]), "default": label(default),
            "default_us": results.get(label(default)), "all": results, "rejected": rejected,
            "same_as_pointer_loads": same_as_pointer, "_configs": results_out}


def tiles_table(sweeps: dict) -> str:
    """Python to paste into `tiles()` (bf16/fp16): per (N, K), the candidate with the least time summed over the
    products of that shape (and over the sweep's row counts), among those every such product measured."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for name, n, k, _ in SHAPES:
        if name in sweeps:
            by_shape.setdefault((n, k), []).append(sweeps[name])
    lines = ["# the H200 sweep's best per (N, K), summed over its row counts; bf16/fp16 (fp32 keeps its rule)",
             "SWEPT = {"]
    for (n, k), runs in sorted(by_shape.items()):
        common = set.intersection(*(set(r["all"]) for r in runs))
        if not common:
            lines.append(f"    # ({n}, {k}): no candidate measured on every product of this shape")
            continue
        best = min(common, key=lambda key: sum(r["all"][key] for r in runs))
        total = sum(r["all"][best] for r in runs)
        default = sum(r["all"].get(r["default"], float("nan")) for r in runs)
        lines.append(f"    ({n}, {k}): {source(runs[0]['_configs'][best])},  # {total:.1f} us (tiles(): {default:.1f})")
    lines += ["}", "# in tiles(), after the fp32 rule:", "#     if (n, k) in SWEPT:", "#         return SWEPT[(n, k)]"]
    return "\n".join(lines)


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
    ap.add_argument("--sweep-rows", default="64,256,512")
    ap.add_argument("--tiles-table", action="store_true",
                    help="sweep, then print the best configuration per (N, K) as Python for tiles()")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.sweep = args.sweep or args.tiles_table
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
            start = time.perf_counter()
            report["sweep"][name] = sweep(name, n, k, has_bias, [int(r) for r in args.sweep_rows.split(",")], args)
            summary = {key: v for key, v in report["sweep"][name].items() if key in ("best", "best_us", "default",
                                                                                     "default_us", "rejected")}
            print(json.dumps({name: {**summary, "sweep_s": round(time.perf_counter() - start, 1)}}), flush=True)
    if args.sweep and args.tiles_table:
        print(tiles_table(report["sweep"]), flush=True)
    for result in report["sweep"].values():
        result.pop("_configs")
    report["compiled"] = compiled_check(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
