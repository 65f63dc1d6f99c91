"""The batch-invariant GEMM (stages/invariant_matmul.py) against cuBLAS on the 1.7B Talker's and code predictor's
products, bf16, at decode and prefill row counts; `--sweep` / `--tiles-table`: the tile sweep that writes `SWEPT`.

Per (product, rows): microseconds per call of cuBLAS (torch.mm) and of the invariant kernel, each timed as a CUDA
graph of `--calls` back-to-back calls cycling weight copies that together exceed the L2 cache (as a step's weights
do), CUDA events around each of `--reps` replays, the median; max error of both against an fp32 reference. Per
product: whether the rows of products of every row count, at several positions, are bit-identical to the same rows
of one `max(rows)`-row product (and the same for cuBLAS, for contrast). Then, with `enable()`, a torch.compile'd
F.linear (dynamic shapes) and a CUDA-graph replay of it: do they take the invariant kernel (rows bit-equal to the
kernel's eager result at every row count)?

`--sweep`, per product: every candidate of `candidates` (tiles x pointer/TMA loads x split-K 1, 2, 4 where the
product is narrow and K deep enough; persistent forms for the widest), grouped by split count into families. On
sm_90 a row's bits follow the split count alone, so each family must give one set of bits: every candidate's
`max(--sweep-rows)`-row output is hashed, and its 1-, 64- and 200-row products must equal the same rows of it; a
family with two hashes, a row that moves or an error past 4x cuBLAS's is reported and excluded. Every candidate is
timed at each `--sweep-rows` count, one per row bucket (im.ROW_BUCKETS). `--tiles-table` then prints `SWEPT` as
Python: per (N, K) the split count minimising the BUCKET_WEIGHTS-weighted sum over buckets of its best time
(products sharing an (N, K) weighted by DECODE_RUNS), then per bucket the best member of that family: one table
entry never mixes configurations that give different bits. `--warm-processes P` first compiles every candidate
in P processes at once (Triton's disk cache); the timing runs in this process, one kernel at a time.

    python -m bench.kernels.invariant_matmul [--rows 1,2,8,64,256,512,2048] [--shapes talker.o,...]
        [--sweep [--sweep-rows 64,128,256,512] [--tiles-table] [--warm-processes 8]] [--out FILE]   # CUDA only

Prints one JSON: {"products": [{"shape", "n", "k", "rows", "cublas_us", "invariant_us", "ratio", "err_invariant",
"err_cublas"}], "invariance": {shape: {"invariant": true, "cublas": false}}, "compiled": {...}, "sweep": {shape:
{"families": {split: {"ok", "hashes", ...}}, "times": {config: {rows: us}}, "best", "current", "failed", ...}},
"table": {"NxK": {"split", "tiles", "cost", "excluded"}}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import itertools
import json
import subprocess
import sys
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


# --- the tile sweep -------------------------------------------------------------------------------------------------
# Why per split count: on sm_90 a row's bits follow only the split count (and the K order the kernel fixes), not
# BLOCK_M/N/K, warps, stages, TMA or a persistent grid (stages/invariant_matmul.py, `SWEPT`). So the candidates of one
# split count form a family that must give one set of bits, and `tiles()` may pick any member per row bucket; the
# sweep checks the family, never trusts it.
ROW_TILES = ((64, 4), (128, 8))  # (BLOCK_M, warps): one warpgroup on 64 rows, two on 128
COLUMN_TILES = (32, 64, 128, 256)  # narrow tiles give narrow products enough programs at decode, wide ones prefill
DEPTHS = {64: 4, 128: 3}  # BLOCK_K: pipeline stages
PIPELINE_BYTES = 200_000  # a candidate's staged bf16 operand tiles fit in the H200's 228 KB shared memory per SM
SPLITS = (1, 2, 4)  # split-K counts tried...
SPLIT_MAX_N = 6144  # ...up to this width (wider products have enough column tiles at decode)...
SPLIT_MIN_CHUNK = 512  # ...and while every chunk keeps this many K columns
INVARIANCE_ROWS = (1, 64, 200)  # a lone row, a whole row tile, a partial one: their rows vs the sweep's largest product
# A bucket's weight in the choice of a shape's split count: the closed loop at 256 streams (deterministic mode's cost)
# runs ~250-row decode steps, so the <= 256 bucket counts three times; order of im.ROW_BUCKETS, then "more"
BUCKET_WEIGHTS = (1, 1, 3, 1)
# How often one decode step runs each product (products sharing an (N, K) get one table entry, chosen for their
# weighted sum): the talker's 28 layers, the code predictor's 5 layers in each of its 15 passes, its input
# projection and head once per pass, the codec head once; the text projection runs in prefills only
DECODE_RUNS = {"talker.qkv": 28, "talker.o": 28, "talker.gate_up": 28, "talker.down": 28, "talker.codec_head": 1,
               "text_proj": 0, "cp.input_proj": 15, "cp.qkv": 75, "cp.o": 75, "cp.gate_up": 75, "cp.down": 75,
               "cp.head": 15}


def candidates(n: int, k: int) -> list[im.Tiles]:
    """The bf16 configurations the sweep times for an [M, K] x [K, N] product: every (BLOCK_M, warps) x BLOCK_N x
    BLOCK_K of the lists above whose pipeline fits, with pointer and TMA loads, at each split count of `splits`;
    persistent forms of the split-1 ones for products wider than SPLIT_MAX_N (many tiles at prefill); and what
    `tiles()` picks now at each row bucket (so a re-run can keep it)."""
    out = []
    for (bm, warps), bn, (bk, stages) in itertools.product(ROW_TILES, COLUMN_TILES, DEPTHS.items()):
        if stages * (bm + bn) * bk * 2 > PIPELINE_BYTES:
            continue
        for tma, split in itertools.product((False, True), splits(n, k)):
            out.append(im.Tiles(bm, bn, bk, 8, warps, stages, tma=tma, split_k=split))
            if split == 1 and n > SPLIT_MAX_N:
                out.append(dataclasses.replace(out[-1], persistent=True))
    current = [im.tiles(top, n, k, torch.bfloat16) for top in (*im.ROW_BUCKETS, im.ROW_BUCKETS[-1] + 1)]
    return out + [cfg for cfg in dict.fromkeys(current) if cfg not in out]


def splits(n: int, k: int) -> tuple[int, ...]:
    return tuple(s for s in SPLITS if s == 1 or n <= SPLIT_MAX_N and k // s >= SPLIT_MIN_CHUNK)


def label(cfg: im.Tiles) -> str:
    flags = ("tma" if cfg.tma else "") + (" persistent" if cfg.persistent else "") + \
        (f" split{cfg.split_k}" if cfg.split_k > 1 else "")
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{' ' if flags else ''}" \
        f"{flags.strip()}"


def bucket_rows(rows: list[int]) -> list[int]:
    """`--sweep-rows` in bucket order, checked to be one row count per row bucket (im.ROW_BUCKETS, then "more")."""
    buckets = [sum(m > top for top in im.ROW_BUCKETS) for m in rows]
    if sorted(buckets) != list(range(len(im.ROW_BUCKETS) + 1)):
        edges = ", ".join(f"<= {top}" for top in im.ROW_BUCKETS)
        raise ValueError(f"--sweep-rows {rows}: need one row count per row bucket ({edges}, more), got buckets {buckets}")
    return sorted(rows)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:12]


def sweep(name, n, k, has_bias, rows, args) -> dict:
    """Every candidate (`candidates`) of one product: its `max(rows)`-row output hashed, whether the rows of its
    INVARIANCE_ROWS-row products equal the same rows of that output, and its time per call at each of `rows`.
    Per split count, the family: ok when all its candidates gave one hash, every one is row-invariant and the
    error against an fp32 reference is within 4x cuBLAS's. Candidates Triton cannot build or launch (shared memory)
    are listed under "failed"."""
    copies = max(2, min(16, -(-2 * L2_BYTES // (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    top = max(rows)
    x = torch.randn(top, k, device="cuda", dtype=torch.bfloat16)
    w = weights[0]
    ref = F.linear(x.float(), w.float(), bias.float() if has_bias else None)
    tolerance = 4 * (F.linear(x, w, bias).float() - ref).abs().max().item()
    hashes: dict[int, dict[str, list[str]]] = {}
    errors: dict[str, float] = {}
    not_invariant, failed, times, configs = [], {}, {}, {}
    for cfg in candidates(n, k):
        key = label(cfg)
        try:
            full = product_fn("invariant", x, bias, cfg)(w)
            h = digest(full)
            hashes.setdefault(cfg.split_k, {}).setdefault(h, []).append(key)
            errors[h] = (full.float() - ref).abs().max().item()
            if not all(torch.equal(product_fn("invariant", x[:m], bias, cfg)(w), full[:m])
                       for m in INVARIANCE_ROWS if m < top):
                not_invariant.append(key)
            times[key] = {m: round(graph_us([functools.partial(product_fn("invariant", x[:m], bias, cfg),
                                                               weights[i % copies]) for i in range(16)],
                                            max(5, args.reps // 4)), 2) for m in rows}
            configs[key] = dataclasses.asdict(cfg)
        except Exception as e:  # a configuration Triton cannot build or launch
            failed[key] = f"{type(e).__name__}: {e}"[:200]
    families = {}
    for split, by_hash in sorted(hashes.items()):
        members = [key for keys in by_hash.values() for key in keys]
        bad = [key for key in members if key in not_invariant]
        err = max(errors[h] for h in by_hash)
        families[split] = {"ok": len(by_hash) == 1 and not bad and err <= tolerance, "hashes": by_hash,
                           "not_row_invariant": bad, "err": err, "tolerance": tolerance}
    current = {m: label(im.tiles(m, n, k, torch.bfloat16)) for m in rows}
    return {"families": families, "times": times, "configs": configs, "failed": failed,
            "current": {m: [key, times.get(key, {}).get(m)] for m, key in current.items()},
            "best": {m: min(times, key=lambda key: times[key][m]) if times else None for m in rows}}


def choose(sweeps: dict, rows: list[int]) -> dict:
    """Per (N, K) of the swept products (`sweep` results by product name; `rows` one per row bucket, in bucket
    order): the split count whose family is ok on every product of that shape and minimises the sum over buckets
    of BUCKET_WEIGHTS x the bucket's best DECODE_RUNS-weighted time of its members measured on every product,
    then that best member per bucket. Returns {(n, k): {"split", "tiles": [Tiles per bucket], "cost": {split:
    weighted us}, "excluded": {split: why}}}; a shape with no usable family gets split and tiles None."""
    by_shape: dict[tuple[int, int], list[str]] = {}
    for name, n, k, _ in SHAPES:
        if name in sweeps:
            by_shape.setdefault((n, k), []).append(name)
    out = {}
    for shape, names in sorted(by_shape.items()):
        runs = {name: DECODE_RUNS[name] for name in names}
        if not any(runs.values()):  # only prefill products: weigh them equally
            runs = dict.fromkeys(names, 1)
        cost, picks, excluded = {}, {}, {}
        for split in sorted({s for name in names for s in sweeps[name]["families"]}):
            picked = _family_picks(sweeps, runs, split, rows)
            if isinstance(picked, str):
                excluded[split] = picked
                continue
            picks[split], cost[split] = picked
        split = min(cost, key=lambda s: (cost[s], s)) if cost else None
        tiles = [im.Tiles(**sweeps[names[0]]["configs"][key]) for key in picks[split]] if cost else None
        out[shape] = {"split": split, "tiles": tiles, "cost": cost, "excluded": excluded}
    return out


def _family_picks(sweeps: dict, runs: dict[str, int], split: int, rows: list[int]) -> tuple[list[str], float] | str:
    """(the best member per bucket, the weighted cost) of the split-`split` family over the products `runs`
    weighs, or why that family is out."""
    bad = [name for name in runs if not sweeps[name]["families"].get(split, {}).get("ok")]
    if bad:
        return f"not bit-identical, row-invariant and accurate on {', '.join(bad)}"
    members = set.intersection(*({key for keys in sweeps[name]["families"][split]["hashes"].values() for key in keys}
                                 for name in runs))
    members = [key for key in sorted(members) if all(m in sweeps[name]["times"].get(key, {}) for name in runs for m in rows)]
    if not members:
        return "no member timed on every product of this shape"
    weighted = {(key, m): sum(runs[name] * sweeps[name]["times"][key][m] for name in runs) for key in members for m in rows}
    picks = [min(members, key=lambda key: weighted[key, m]) for m in rows]
    return picks, round(sum(w * weighted[key, m] for w, key, m in zip(BUCKET_WEIGHTS, picks, rows, strict=True)), 2)


def source(cfg: im.Tiles) -> str:
    """`cfg` as stages/invariant_matmul.py's `_t(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, variant=...)`."""
    if cfg.group_m != 8:
        raise ValueError(f"{cfg}: SWEPT's _t() has GROUP_M 8")
    extra = "".join(f", {f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)[6:]
                    if getattr(cfg, f.name) != f.default)
    return f"_t({cfg.block_m}, {cfg.block_n}, {cfg.block_k}, {cfg.num_warps}, {cfg.num_stages}{extra})"


def swept_source(table: dict, width: int = 120) -> str:
    """`choose`'s table as the Python of stages/invariant_matmul.py's `SWEPT` (entries wrapped at `width`)."""
    per = ", ".join(["Tiles"] * (len(im.ROW_BUCKETS) + 1))
    lines = [f"SWEPT: dict[tuple[int, int], tuple[{per}]] = {{"]
    for (n, k), choice in sorted(table.items()):
        if choice["tiles"] is None:
            lines.append(f"    # ({n}, {k}): no split family usable on every product of this shape: {choice['excluded']}")
            continue
        line = f"    ({n}, {k}): ("
        indent = " " * len(line)
        items = [source(cfg) for cfg in choice["tiles"]]
        for i, item in enumerate(items):
            end = ")," if i == len(items) - 1 else ","
            if not line.endswith("(") and len(line) + 1 + len(item) + len(end) > width:
                lines.append(line)
                line = indent + item + end
            else:
                line += ("" if line.endswith("(") else " ") + item + end
        lines.append(line)
    return "\n".join([*lines, "}"])


def warm(part: str, wanted: set[str] | None, rows: list[int]) -> None:
    """Compile (into Triton's disk cache) every `part` = "i/P"-th (product, candidate) of the sweep: one launch
    each, failures left to the timed pass to report."""
    i, parts = map(int, part.split("/"))
    jobs = [(n, k, has_bias, cfg) for name, n, k, has_bias in SHAPES if not wanted or name in wanted
            for cfg in candidates(n, k)]
    for n, k, has_bias, cfg in jobs[i::parts]:
        x = torch.randn(max(rows), k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        try:
            product_fn("invariant", x, bias, cfg)(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        except Exception:  # the timed pass reports it
            pass
    torch.cuda.synchronize()


def warm_in_processes(processes: int, args) -> None:
    """`warm` split over `processes` subprocesses at once (Triton compiles on the CPU, one kernel at a time per
    process), so the timed pass in this process finds every candidate compiled."""
    command = [sys.executable, "-m", "bench.kernels.invariant_matmul", "--sweep-rows", args.sweep_rows]
    command += ["--shapes", args.shapes] if args.shapes else []
    procs = [subprocess.Popen([*command, "--warm-part", f"{i}/{processes}"]) for i in range(processes)]
    failed = [i for i, proc in enumerate(procs) if proc.wait() != 0]
    if failed:
        print(json.dumps({"warm_failed_parts": failed}), flush=True)


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
    ap.add_argument("--sweep", action="store_true", help="also time every candidate tile configuration")
    ap.add_argument("--sweep-rows", default="64,128,256,512", help="one row count per row bucket")
    ap.add_argument("--tiles-table", action="store_true", help="sweep, then print SWEPT (stages/invariant_matmul.py)")
    ap.add_argument("--warm-processes", type=int, default=0,
                    help="first compile the sweep's candidates in this many processes at once")
    ap.add_argument("--warm-part", default=None, help=argparse.SUPPRESS)  # one of those processes: "i/P"
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.sweep = args.sweep or args.tiles_table
    sweep_rows = bucket_rows([int(r) for r in args.sweep_rows.split(",")])
    wanted = set(args.shapes.split(",")) if args.shapes else None
    if args.warm_part:
        warm(args.warm_part, wanted, sweep_rows)
        return
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "products": [], "invariance": {},
              "sweep": {}}
    if args.sweep and args.warm_processes > 0:
        start = time.perf_counter()
        warm_in_processes(args.warm_processes, args)
        print(json.dumps({"warm_s": round(time.perf_counter() - start, 1)}), flush=True)
    for name, n, k, has_bias in SHAPES:
        if wanted and name not in wanted:
            continue
        products, same = timings(name, n, k, has_bias, rows, args)
        report["products"] += products
        report["invariance"][name] = same
        if args.sweep:
            start = time.perf_counter()
            result = report["sweep"][name] = sweep(name, n, k, has_bias, sweep_rows, args)
            print(json.dumps({name: {"families": {s: {key: f[key] for key in ("ok", "not_row_invariant", "err")}
                                                  | {"hashes": {h: len(v) for h, v in f["hashes"].items()}}
                                                  for s, f in result["families"].items()},
                                     "best": result["best"], "current": result["current"],
                                     "failed": len(result["failed"]), "sweep_s": round(time.perf_counter() - start, 1)}}),
                  flush=True)
    if args.tiles_table:
        table = choose(report["sweep"], sweep_rows)
        report["table"] = {f"{n}x{k}": {**choice, "tiles": [label(t) for t in choice["tiles"] or []]}
                           for (n, k), choice in table.items()}
        print(swept_source(table), flush=True)
    report["compiled"] = compiled_check(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
