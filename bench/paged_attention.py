"""Tiling sweep of the Triton decode-attention kernel (stages/talker/paged_attention.py) on the shapes the
talker decodes: microseconds per call and effective HBM bandwidth (K and V bytes read / time), each variant timed
as a CUDA graph of back-to-back calls (as the engine's graphs run it), with and without `loads_first` (each
tile's V load issued with its K load).

    python -m bench.paged_attention                     # CUDA only; ~2 min
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from bench.gemv import graph_us
from stages.talker.paged_attention import contiguous_decode_attention, decode_tiling, paged_decode_attention


def time_us(fn, calls: int = 24) -> float:
    """Microseconds per call: `calls` calls captured in one CUDA graph (launch cost as inside the step's graph)."""
    return graph_us([fn] * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256,512")
    ap.add_argument("--keys", default="160,420", help="keys per row (prompt + frames so far)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    heads, n_kv, d, page = 16, 8, 128, 16
    rows = []
    for b, keys in itertools.product(map(int, args.batches.split(",")), map(int, args.keys.split(","))):
        per = -(-keys // page)
        blocks = b * per + 1
        k_pool = torch.randn(blocks * page, n_kv, d, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        table = torch.randperm(blocks, device="cuda")[:b * per].view(b, per)
        lens = torch.full((b,), keys, device="cuda")
        q = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
        ref = paged_decode_attention(q, k_pool, v_pool, table, lens, page)
        nbytes = 2 * b * keys * n_kv * d * 2
        results = []
        for block, warps, stages, first in itertools.product((16, 32, 64), (1, 2, 4, 8), (1, 2, 3), (False, True)):
            call = functools.partial(paged_decode_attention, q, k_pool, v_pool, table, lens, page, block, warps, stages,
                                     loads_first=first)
            try:
                err = (call().float() - ref.float()).abs().max().item()
                us = time_us(call)
            except Exception as e:  # a tiling Triton cannot build (shared memory)
                print(f"b={b} keys={keys} block={block} warps={warps} stages={stages}: {type(e).__name__}")
                continue
            results.append(dict(block=block, warps=warps, stages=stages, loads_first=first, us=round(us, 2),
                                gb_s=round(nbytes / us / 1e3, 1), max_diff=err))
        results.sort(key=lambda r: r["us"])
        engine = (*decode_tiling(b), 2)  # paged_decode_attention's tiling and num_stages
        default, first = (next(r for r in results if (r["block"], r["warps"], r["stages"]) == engine
                               and r["loads_first"] == f) for f in (False, True))
        print(f"batch {b}, {keys} keys: engine's tiling {default['us']} us ({default['gb_s']} GB/s), with loads_first "
              f"{first['us']} us; best " + ", ".join(
                  f"{r['block']}/{r['warps']}/{r['stages']}{'/first' if r['loads_first'] else ''} {r['us']} us "
                  f"({r['gb_s']} GB/s)" for r in results[:4]), flush=True)
        rows.append(dict(batch=b, keys=keys, default=default, loads_first=first, best=results[:6]))
    for b in map(int, args.batches.split(",")):  # the code predictor's contiguous cache: 16 positions
        k = torch.randn(b, n_kv, 16, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
        rows_idx, n = torch.arange(b, device="cuda")[:, None], torch.tensor([16], device="cuda")
        timings = {w: round(time_us(functools.partial(contiguous_decode_attention, q, k, v, rows_idx, n, w)), 2)
                   for w in (1, 2, 4, 8)}
        print(f"contiguous (code predictor), batch {b}, 16 keys: us by num_warps {timings}", flush=True)
        rows.append(dict(contiguous=True, batch=b, keys=16, us_by_warps=timings))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
