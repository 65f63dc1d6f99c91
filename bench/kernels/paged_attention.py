"""Tiling sweep of the Triton decode-attention kernels (stages/talker/paged_attention.py: on CUDA cores and on
tensor cores) on the shapes the talker decodes: microseconds per call and effective HBM bandwidth (K and V bytes
read / time), each variant timed as a CUDA graph of back-to-back calls (as the engine's graphs run it); then, at a
few rows, each row's keys split over 1-32 programs (`splits`, merged by a second kernel) with the new key's store
and the head prologue as in the decode step.

    python -m bench.kernels.paged_attention                     # CUDA only; ~3 min
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from bench.kernels.timing import graph_us
from stages.talker.paged_attention import (
    DecodeTiling,
    HeadNorm,
    contiguous_decode_attention,
    contiguous_tiling,
    decode_splits,
    decode_tiling,
    paged_decode_attention,
)

HEADS, N_KV, D, PAGE = 16, 8, 128, 16  # the 1.7B talker's attention
FEW_ROWS_CUDA_CORES = DecodeTiling(32, 4)  # the CUDA-core kernel's best tiling below 64 rows (the splits sweep's)


def paged_inputs(b: int, keys: int) -> tuple[torch.Tensor, ...]:
    """q [b, H, D], K/V pools with each row's `keys` positions on shuffled pages, block table, lengths."""
    per = -(-keys // PAGE)
    blocks = b * per + 1
    k_pool = torch.randn(blocks * PAGE, N_KV, D, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    table = torch.randperm(blocks, device="cuda")[:b * per].view(b, per)
    lens = torch.full((b,), keys, device="cuda")
    q = torch.randn(b, HEADS, D, device="cuda", dtype=torch.bfloat16)
    return q, k_pool, v_pool, table, lens


def tilings(kernels: str) -> list[DecodeTiling]:
    """The swept tilings: keys per iteration x warps x stages, of the CUDA-core and/or the tensor-core kernel."""
    out = []
    if "cuda_cores" in kernels:
        out += [DecodeTiling(*t) for t in itertools.product((16, 32, 64), (1, 2, 4, 8), (1, 2, 3))]
    if "tensor_cores" in kernels:
        out += [DecodeTiling(*t, tensor_cores=True) for t in itertools.product((16, 32, 64, 128), (2, 4, 8), (2, 3, 4))]
    return out


def time_us(fn, calls: int = 24) -> float:
    """Microseconds per call: `calls` calls captured in one CUDA graph (launch cost as inside the step's graph)."""
    return graph_us([fn] * calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256,512")
    ap.add_argument("--keys", default="160,420", help="keys per row (prompt + frames so far)")
    ap.add_argument("--split-batches", default="1,2,4,8", help="batches of the splits sweep")
    ap.add_argument("--split-keys", default="160,420,1000,2000", help="keys per row in the splits sweep")
    ap.add_argument("--kernels", default="cuda_cores,tensor_cores",
                    help="which kernels' tilings to sweep on the paged cache (none: the contiguous cache's sweep only)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    heads, n_kv, d, page = HEADS, N_KV, D, PAGE
    rows = []
    paged_sweep = itertools.product(map(int, args.batches.split(",")), map(int, args.keys.split(",")))
    for b, keys in paged_sweep if tilings(args.kernels) else ():
        q, k_pool, v_pool, table, lens = paged_inputs(b, keys)
        ref = paged_decode_attention(q, k_pool, v_pool, table, lens, page)
        nbytes = 2 * b * keys * n_kv * d * 2
        results = []
        for tiling in tilings(args.kernels):
            call = functools.partial(paged_decode_attention, q, k_pool, v_pool, table, lens, page, tiling)
            try:
                err = (call().float() - ref.float()).abs().max().item()
                us = time_us(call)
            except Exception as e:  # a tiling Triton cannot build (shared memory)
                print(f"b={b} keys={keys} {tiling}: {type(e).__name__}")
                continue
            results.append(dict(block=tiling.keys, warps=tiling.warps, stages=tiling.stages,
                                tensor_cores=tiling.tensor_cores, us=round(us, 2), gb_s=round(nbytes / us / 1e3, 1),
                                max_diff=err))
        results.sort(key=lambda r: r["us"])
        engine = decode_tiling(b)
        default = next((r for r in results if DecodeTiling(r["block"], r["warps"], r["stages"], r["tensor_cores"])
                        == engine), None)  # None: the engine's tiling was not among the swept ones
        engines = f"{default['us']} us ({default['gb_s']} GB/s)" if default else "not swept"
        print(f"batch {b}, {keys} keys: engine's tiling {engines}; best " + ", ".join(
                  f"{'tc' if r['tensor_cores'] else 'cc'} {r['block']}/{r['warps']}/{r['stages']} {r['us']} us "
                  f"({r['gb_s']} GB/s)" for r in results[:4]), flush=True)
        rows.append(dict(batch=b, keys=keys, default=default, best=results[:6]))
    for b, keys in itertools.product(map(int, args.split_batches.split(",")), map(int, args.split_keys.split(","))):
        q, k_pool, v_pool, table, lens = paged_inputs(b, keys)
        new_kv = (torch.randn(b, n_kv, d, device="cuda", dtype=torch.bfloat16),) * 2
        ones = torch.ones(d, device="cuda", dtype=torch.bfloat16)
        angle = torch.rand(b, 1, 1, d, device="cuda")
        head_norm = HeadNorm(ones, ones, 1e-6, angle.cos().bfloat16(), angle.sin().bfloat16())
        ref = paged_decode_attention(q, k_pool, v_pool, table, lens, page, new_kv=new_kv, head_norm=head_norm)
        for tiling in [FEW_ROWS_CUDA_CORES] * ("cuda_cores" in args.kernels) + [decode_tiling(b)] * (
                "tensor_cores" in args.kernels):
            step_call = functools.partial(paged_decode_attention, q, k_pool, v_pool, table, lens, page, tiling,
                                          new_kv=new_kv, head_norm=head_norm)  # as the decode step calls it
            timings, errs = {}, {}
            for splits in (1, 2, 4, 8, 16, 32):
                call = functools.partial(step_call, splits=splits)
                errs[splits] = (call().float() - ref.float()).abs().max().item()
                timings[splits] = round(time_us(call), 2)
            print(f"splits, batch {b}, {keys} keys (new key + head prologue), {tiling}: us {timings}; decode_splits: "
                  f"{decode_splits(b, n_kv)}; max |diff| vs the engine's 1 split {max(errs.values()):.1e}", flush=True)
            rows.append(dict(splits_sweep=True, batch=b, keys=keys, tensor_cores=tiling.tensor_cores,
                             us_by_splits=timings, max_diff=max(errs.values()), decode_splits=decode_splits(b, n_kv)))
    for b in map(int, args.batches.split(",")):  # the code predictor's contiguous cache: 16 positions
        k = torch.randn(b, n_kv, 16, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(b, heads, d, device="cuda", dtype=torch.bfloat16)
        rows_idx, n = torch.arange(b, device="cuda")[:, None], torch.tensor([16], device="cuda")
        timings = {f"{'tc' if tc else 'cc'} w{w}": round(time_us(functools.partial(
            contiguous_decode_attention, q, k, v, rows_idx, n, DecodeTiling(16, w, tensor_cores=tc))), 2)
            for tc in (False, True) for w in (1, 2, 4, 8)}
        print(f"contiguous (code predictor), batch {b}, 16 keys: us by kernel and num_warps {timings}; "
              f"contiguous_tiling: {contiguous_tiling(b)}", flush=True)
        rows.append(dict(contiguous=True, batch=b, keys=16, us_by_tiling=timings))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
