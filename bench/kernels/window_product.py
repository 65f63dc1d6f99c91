"""The deterministic Code2Wav's convolutions: stages/invariant_conv.py (the window kernel of stages/window_product.py
for dense and transposed convolutions, fp32 taps for depthwise ones) against cuDNN, per convolution a deterministic
decode issues, and a tile sweep for the window kernel.

Records the aten::convolution calls of a deterministic engine decoding `--streams` streams of ~40 frames chunk by
chunk (the default schedule, eager fused path: the same convolutions the graphs replay), then per distinct call
(shapes, strides, dtype, arguments): microseconds of cuDNN (aten's kernel, the process's cuDNN flags as the
deterministic engine sets them) and of the override, each a CUDA graph of back-to-back calls, and the totals over the
decode (time x calls). `--sweep`: per window-kernel problem (C input channels, N output columns: what
`window_product.tiles` sees) the candidate tiles, each timed over that problem's calls (a candidate Triton cannot
build is skipped); `--tiles-table` prints the best per (C, N) as Python for `window_product.tiles`. Any tiles fixed
per (C, N) keep a row's bits independent of the batch, so the sweep needs no invariance check.

    python -m bench.kernels.window_product [--streams 64] [--sweep [--tiles-table]] [--out FILE]   # CUDA only

Prints one JSON: {"calls": [{"call", "count", "cudnn_us", "override_us"}], "total_ms": {"cudnn", "override"},
"sweep": {"C x N": {"best", "best_us", "default", "default_us"}}}.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
from dataclasses import dataclass

import numpy as np
import torch

from bench.code2wav import build_decoder
from bench.kernels.timing import graph_us
from stages import invariant_conv, window_product
from stages.chunking import ChunkSchedule, StreamChunker
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) the sweep tries for every problem
CANDIDATES = ((64, 16, 32, 4, 3), (64, 32, 32, 4, 3), (64, 64, 32, 4, 3), (64, 64, 64, 4, 3), (64, 128, 32, 4, 3),
              (128, 16, 32, 4, 3), (128, 16, 64, 4, 3), (128, 32, 32, 4, 3), (128, 64, 32, 4, 3), (128, 64, 32, 8, 3),
              (128, 64, 32, 8, 4), (128, 64, 64, 8, 3), (128, 128, 32, 8, 3), (256, 16, 32, 8, 2), (256, 32, 32, 8, 3),
              (256, 64, 32, 8, 3))


@dataclass(frozen=True)
class Call:
    """One aten::convolution call as the decode issued it (what is needed to issue it again)."""
    x_shape: tuple
    x_stride: tuple
    w_shape: tuple
    w_stride: tuple
    bias: bool
    stride: tuple
    padding: tuple
    dilation: tuple
    transposed: bool
    output_padding: tuple
    groups: int
    dtype: torch.dtype

    def label(self) -> str:
        kind = "transposed" if self.transposed else "depthwise" if self.groups > 1 else "dense"
        return f"{kind} x{list(self.x_shape)} w{list(self.w_shape)} s{list(self.stride)} d{list(self.dilation)}"

    def problem(self) -> tuple[int, int] | None:
        """(C, N) as `window_product.tiles` sees it; None for the depthwise form (not the window kernel)."""
        if self.groups > 1:
            return None
        if self.transposed:
            axis = next((a for a in range(len(self.stride)) if self.stride[a] != 1), len(self.stride) - 1)
            return self.w_shape[0], self.stride[axis] * self.w_shape[1]
        return self.w_shape[1], self.w_shape[0]

    def tensors(self) -> tuple:
        def make(shape, stride):
            return torch.empty_strided(shape, stride, dtype=self.dtype, device="cuda").normal_()
        bias = torch.randn(self.w_shape[1] if self.transposed else self.w_shape[0], dtype=self.dtype, device="cuda")
        return make(self.x_shape, self.x_stride), make(self.w_shape, self.w_stride).mul_(0.05), bias if self.bias else None

    def args(self) -> tuple:
        return (list(self.stride), list(self.padding), list(self.dilation), self.transposed, list(self.output_padding),
                self.groups)


def record(streams: int) -> collections.Counter:
    """The convolution calls (and how often each) of a deterministic engine decoding `streams` streams chunk by
    chunk: the override's entry point wrapped while the engine registers it."""
    decoder = build_decoder(False, "cuda", torch.bfloat16)
    schedule = ChunkSchedule()
    rng = np.random.default_rng(0)
    engine = Code2WavEngine(decoder, Code2WavEngineConfig.for_schedule(
        schedule, max_batch_size=64, state_slots=1024, deterministic=True, cuda_graphs=False, compile=False))
    engine.warmup(lambda _m: None)
    work = []
    for i in range(streams):
        chunker = StreamChunker(schedule, f"s{i}")
        chunks = chunker.push(rng.integers(0, 2048, (40 + i % 7, 16)))
        work.append(chunks + [c for c in [chunker.flush()] if c is not None])
    calls: collections.Counter = collections.Counter()
    original = invariant_conv.convolution

    def recording(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
        calls[Call(tuple(x.shape), x.stride(), tuple(weight.shape), weight.stride(), bias is not None, tuple(stride),
                   tuple(padding), tuple(dilation), transposed, tuple(output_padding), groups, x.dtype)] += 1
        return original(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)

    invariant_conv.convolution = recording
    try:
        for k in range(max(len(s) for s in work)):
            engine.decode([s[k] for s in work if k < len(s)])
    finally:
        invariant_conv.convolution = original
    torch.cuda.synchronize()
    return calls


def time_call(call: Call, kind: str, reps: int) -> float:
    x, w, b = call.tensors()
    if kind == "cudnn":
        cudnn = torch.backends.cudnn
        def fn():
            return torch.ops.aten._convolution.default(x, w, b, *call.args(), cudnn.benchmark, cudnn.deterministic,
                                                       cudnn.enabled, cudnn.allow_tf32)
    else:
        def fn():
            return invariant_conv.convolution(x, w, b, *call.args())
    return graph_us([fn] * 4, reps)


@contextlib.contextmanager
def tiles_fixed(cfg: window_product.ConvTiles):
    original = window_product.tiles
    window_product.tiles = lambda _c, _n: cfg
    try:
        yield
    finally:
        window_product.tiles = original


def sweep(calls: collections.Counter, reps: int) -> dict:
    """Per (C, N): each candidate's time over that problem's calls (x their counts), the best and the default's."""
    problems: dict[tuple[int, int], list[Call]] = collections.defaultdict(list)
    for call in calls:
        if call.problem() is not None:
            problems[call.problem()].append(call)
    out = {}
    for (c, n), group in sorted(problems.items()):
        default = window_product.tiles(c, n)
        times = {}
        for cfg in {default, *(window_product.ConvTiles(*values) for values in CANDIDATES)}:
            try:
                with tiles_fixed(cfg):
                    times[cfg] = sum(time_call(call, "override", reps) * calls[call] for call in group)
            except Exception as e:  # a configuration Triton cannot build (shared memory, registers)
                print(json.dumps({"skipped": str(cfg), "why": f"{type(e).__name__}: {e}"[:160]}), flush=True)
        best = min(times, key=times.get)
        out[(c, n)] = {"best": best, "best_us": round(times[best], 1), "default": default,
                       "default_us": round(times.get(default, float("nan")), 1)}
        print(json.dumps({f"{c} x {n}": {k: str(v) for k, v in out[(c, n)].items()}}), flush=True)
    return out


def tiles_table(result: dict) -> str:
    lines = ["# the H200 sweep's best window-kernel tiles per (C, N) over a deterministic decode's calls",
             "SWEPT = {"]
    for (c, n), r in sorted(result.items()):
        t = r["best"]
        lines.append(f"    ({c}, {n}): ConvTiles({t.block_m}, {t.block_n}, {t.block_k}, {t.num_warps}, "
                     f"{t.num_stages}),  # {r['best_us']:.0f} us (tiles(): {r['default_us']:.0f})")
    return "\n".join(lines + ["}"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10, help="graph replays timed per call (the median is reported)")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tiles per window-kernel problem")
    ap.add_argument("--tiles-table", action="store_true", help="sweep, then print the best tiles as Python")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = False  # as the deterministic engine sets them
    torch.backends.cudnn.deterministic = True
    calls = record(args.streams)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": [], "total_ms": {}}
    totals = collections.Counter()
    for call, count in sorted(calls.items(), key=lambda kv: kv[0].label()):
        row = {"call": call.label(), "count": count}
        for kind in ("cudnn", "override"):
            row[f"{kind}_us"] = round(time_call(call, kind, args.reps), 1)
            totals[kind] += row[f"{kind}_us"] * count / 1e3
        report["calls"].append(row)
        print(json.dumps(row), flush=True)
    report["total_ms"] = {k: round(v, 1) for k, v in totals.items()}
    if args.sweep or args.tiles_table:
        result = sweep(calls, args.reps)
        report["sweep"] = {f"{c} x {n}": {k: str(v) for k, v in r.items()} for (c, n), r in result.items()}
        if args.tiles_table:
            print(tiles_table(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps({"total_ms": report["total_ms"]}))


if __name__ == "__main__":
    main()
