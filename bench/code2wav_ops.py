"""Per-op timing of the Code2Wav vocoder at the shapes a chunk produces: each conv in the channels-first layout
(cuDNN's NCHW, the fused path before 2026-11-23) against the time-major one (NHWC, `stages/code2wav/fast.py`),
the transposed convs also as one GEMM plus an overlap-add, and the SnakeBeta kernel per tile shape.

Why: a whole-decoder number says that a layout is faster, not which op is slower at which shape (cuDNN picks
its kernels by heuristics; a fallback kernel at an odd shape can cost 10x). Full-size decoder, bf16, CUDA only.

    python -m bench.code2wav_ops --batches 1,64,256 --frames 1,4,25 --out bench/out/c2w_ops.json
"""

# ruff: noqa: B023  (the lambdas below are timed at once, inside the loop iteration that made them)
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.code2wav import build_decoder
from stages.code2wav import fast


def cuda_ms(fn: Callable[[], object], reps: int) -> float:
    """Median ms of `fn` over `reps` runs, timed with CUDA events (after 2 warm-up runs)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def channels_first_dilated(h: torch.Tensor, layer: torch.nn.Conv1d) -> torch.Tensor:
    """The channels-first fused path's dilated conv (before the time-major layout: the view from 256 channels)."""
    d = layer.dilation[0]
    if d == 1 or h.shape[1] < 256:
        return F.conv1d(h, layer.weight, dilation=d)
    B, C, T = h.shape
    y = F.conv2d(h.view(B, C, T // d, d), layer.weight.unsqueeze(-1))
    return y.view(B, y.shape[1], -1)


def snake_tiles(name: str, x: torch.Tensor, act, batch: int, frames: int, reps: int) -> dict:
    """The time-major SnakeBeta kernel per (BLOCK_T, BLOCK_C) tile, and the GB/s of its best."""
    x = fast.time_major(x)
    row = dict(op=name, batch=batch, frames=frames, shape=list(x.shape))
    default = (fast._BLOCK_T, fast._BLOCK_C)
    try:
        for bt, bc in ((64, 64), (32, 128), (128, 32), (16, 128)):
            fast._BLOCK_T, fast._BLOCK_C = bt, bc
            row[f"tile{bt}x{bc}_ms"] = cuda_ms(lambda: fast.snake(x, act, 1), reps)
    finally:
        fast._BLOCK_T, fast._BLOCK_C = default
    best = min(v for k, v in row.items() if k.startswith("tile"))
    row["best_gb_per_s"] = 2 * x.numel() * x.element_size() / best / 1e6
    return row


def ops_at(decoder, batch: int, frames: int, reps: int) -> list[dict]:
    """Time every vocoder op at the shapes of a `frames`-frame chunk (state columns in front, as when streaming)."""
    first, *blocks, act, last = decoder.decoder
    dev, dtype = first.conv.weight.device, first.conv.weight.dtype
    rows: list[dict] = []

    def both(name: str, make_cf: Callable[[], torch.Tensor], cf: Callable, tm: Callable, **extra) -> None:
        x_cf = make_cf()
        x_tm = fast.time_major(x_cf)
        row = dict(op=name, batch=batch, frames=frames, shape=list(x_cf.shape),
                   channels_first_ms=cuda_ms(lambda: cf(x_cf), reps), time_major_ms=cuda_ms(lambda: tm(x_tm), reps))
        for key, fn in extra.items():
            row[f"{key}_ms"] = cuda_ms(lambda fn=fn: fn(x_tm), reps)
        rows.append(row)

    def rand(c: int, t: int) -> torch.Tensor:
        return torch.randn(batch, c, t, device=dev, dtype=dtype)

    T = frames * 4  # samples per frame entering the vocoder (after the 2x2 ConvNeXt upsamplers)
    both("first", lambda: rand(first.conv.in_channels, first.left_pad + T),
         lambda x: F.conv1d(x, first.conv.weight, first.conv.bias), lambda x: fast.conv(x, first.conv, first.conv.bias))
    for b, block in enumerate(blocks):
        snake, up, *units = block.block
        r = up.conv.stride[0]
        both(f"up{b}", lambda: rand(up.conv.in_channels, T + 1),
             lambda x: F.conv_transpose1d(x, up.conv.weight, stride=r), lambda x: fast.conv_transpose(x, up.conv),
             gemm=lambda x: fast.upsample(x, up.conv))
        rows.append(snake_tiles(f"snake{b}", rand(up.conv.in_channels, T), snake, batch, frames, reps))
        T *= r
        for u, unit in enumerate(units):
            c1 = unit.conv1.conv
            d = c1.dilation[0]
            padded = unit.conv1.left_pad + T + (-T) % d
            both(f"block{b}.unit{u}.conv1(d={d})", lambda: rand(c1.in_channels, padded),
                 lambda x: channels_first_dilated(x, c1), lambda x: fast.dilated_conv(x, c1),
                 native=lambda x: fast.conv(x, c1), view=lambda x: fast.dilated_view_conv(x, c1))
            both(f"block{b}.unit{u}.conv2", lambda: rand(c1.out_channels, T),
                 lambda x: F.conv1d(x, unit.conv2.conv.weight), lambda x: fast.pointwise(x, unit.conv2.conv))
    both("last", lambda: rand(last.conv.in_channels, last.left_pad + T),
         lambda x: F.conv1d(x, last.conv.weight, last.conv.bias), lambda x: fast.conv(x, last.conv, last.conv.bias))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--frames", default="1,4,25")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench.code2wav_ops needs a CUDA device")
    decoder = build_decoder(False, "cuda", torch.bfloat16)
    rows = []
    with torch.inference_mode():
        for b in (int(x) for x in args.batches.split(",")):
            for f in (int(x) for x in args.frames.split(",")):
                for row in ops_at(decoder, b, f, args.reps):
                    rows.append(row)
                    times = "  ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items() if k.endswith("_ms"))
                    gbs = f"  {row['best_gb_per_s']:.0f} GB/s" if "best_gb_per_s" in row else ""
                    print(f"b{b:<4} f{f:<3} {row['op']:<24} {str(row['shape']):<20} {times}{gbs}", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
