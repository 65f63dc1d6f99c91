"""Where a first chunk's decode goes, kernel by kernel: the codec decoder as the Talker's first-chunk decoder runs it
(deployments/talker/first_chunk_decoder.py: stateless, CUDA graphs for batches 1, 2, 4, 8 of the first chunk and of chunk
1 over it), a random full-size decoder in bf16. Per shape: the graph's replay, `Code2WavEngine.decode` end to end
(host staging, replay, copy back), and the eager forward under the torch profiler, its kernels grouped by name and
by the decoder stage that launched them.

    python -m bench.first_chunk_kernels --shapes 1x1,8x1,1x3,8x3 --top 20 [--compile]

Served on an H100 (docs/benchmarks.md), the Talker's `talker_decode` stage of first audio at one stream is 4-5 ms;
this says how much of it is the decoder's own device time and which stage holds it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.code2wav import build_decoder
from bench.gpu_timing import kernel_groups, timed
from deployments.talker.first_chunk_decoder import engine_config
from stages.chunking import ChunkSchedule
from stages.code2wav.engine import Code2WavEngine
from stages.contract import CodecChunk

STAGES = ("quantizer", "pre_conv", "pre_transformer", "upsample", "decoder")  # Code2WavDecoder's, in order


def stage_markers(decoder) -> None:
    """Name each top-level stage's kernels in the profile (a forward pre/post hook pair per stage)."""
    for name in STAGES:
        module = getattr(decoder, name)
        first = last = module
        while isinstance(first, torch.nn.ModuleList):  # upsample and decoder are lists (of lists): their ends
            first = first[0]
        while isinstance(last, torch.nn.ModuleList):
            last = last[-1]
        scope: dict[str, record_function] = {}

        def enter(_m, _a, name=name, scope=scope):
            scope["r"] = record_function(f"stage::{name}")
            scope["r"].__enter__()

        def leave(_m, _a, _o, scope=scope):
            scope.pop("r").__exit__(None, None, None)

        first.register_forward_pre_hook(enter)
        last.register_forward_hook(leave)


def stage_kernels(prof, iters: int) -> dict[str, dict[str, float]]:
    """Kernels launched inside each decoder stage's range (`stage_markers`): their count and ms per forward."""
    stages: dict[str, list[float]] = {}
    for e in prof.events():  # kernels launched inside a stage's range: their count and device time
        if e.name.startswith("stage::") and e.device_type == torch.autograd.DeviceType.CPU:
            kernels = [k for op in _descendants(e) for k in op.kernels]
            s = stages.setdefault(e.name[7:], [0, 0.0])
            s[0] += len(kernels) / iters
            s[1] += sum(k.duration for k in kernels) / 1e3 / iters
    return {k: {"kernels": v[0], "ms": v[1]} for k, v in stages.items()}


def _descendants(event):
    yield event
    for child in event.cpu_children:
        yield from _descendants(child)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1x1,8x1,1x3,8x3", help="batch x frames per forward")
    ap.add_argument("--first-chunk-frames", type=int, default=1, help="the schedule's first chunk (serving: 1)")
    ap.add_argument("--compile-cache-dir", help="with --compile: keep (or read) torch.compile's work there")
    ap.add_argument("--max-batch", type=int, default=8, help="the first-chunk decoder's largest batch")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--top", type=int, default=20, help="kernel groups to print per shape")
    ap.add_argument("--compile", action="store_true", help="the engine's compiled dequantizer and pre-transformer "
                    "(stages/code2wav/compiled.py), as a Talker that compiles builds it")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "a GPU benchmark"
    decoder = build_decoder(tiny=False, device="cuda", dtype=torch.bfloat16)
    schedule = ChunkSchedule(first_chunk_frames=args.first_chunk_frames, steady_chunk_frames=25, left_context_frames=25)
    config, first, second = engine_config(schedule, args.max_batch, args.compile, args.compile_cache_dir)
    engine = Code2WavEngine(decoder, config)  # the engine the Talker's first-chunk decoder builds
    t0 = time.perf_counter()
    engine.warmup(print)
    warmup_s = time.perf_counter() - t0
    print(f"warm-up (compile, graphs) {warmup_s:.1f} s")
    if not args.compile:  # (a compiled stage's kernels are not attributed to it)
        stage_markers(decoder)
    rng = np.random.default_rng(0)
    results = []
    for shape in args.shapes.split(","):
        b, t = (int(x) for x in shape.split("x"))
        graph = engine._graphs.get((b, t))
        assert graph is not None, f"no graph for batch {b} x {t} frames (graphed lengths {first}, {second})"
        chunks = [CodecChunk(f"r{i}", 0, rng.integers(0, 2048, (t, 16), dtype=np.int64), 0) for i in range(b)]
        replay_ms = timed(graph.graph.replay, args.iters)
        decode_ms = timed(lambda chunks=chunks: engine.decode(chunks, checked=True), args.iters)
        codes = torch.from_numpy(np.stack([c.codes.T for c in chunks])).cuda()
        with torch.inference_mode():
            engine._run(codes, None)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    engine._run(codes, None)
                torch.cuda.synchronize()
        rows, stages = kernel_groups(prof, args.iters, skip_prefix="stage::"), stage_kernels(prof, args.iters)
        kernels, device_ms = sum(r[1] for r in rows), sum(r[2] for r in rows)
        print(f"\n== batch {b} x {t} frames: graph replay {replay_ms:.2f} ms, decode() {decode_ms:.2f} ms; eager "
              f"{kernels:.0f} kernels, {device_ms:.2f} ms of device time")
        print("stages: " + ", ".join(f"{k} {v['kernels']:.0f} kernels {v['ms']:.3f} ms" for k, v in stages.items()))
        print("| kernel | per forward | ms |\n|---|---:|---:|")
        for name, count, ms in rows[:args.top]:
            print(f"| {name} | {count:.0f} | {ms:.3f} |")
        results.append({"batch": b, "frames": t, "graph_replay_ms": replay_ms, "decode_ms": decode_ms,
                        "kernels": kernels, "device_ms": device_ms, "stages_ms": stages,
                        "groups": [{"kernel": r[0], "per_forward": r[1], "ms": r[2]} for r in rows]})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "first_chunk_frames": first, "chunk1_frames": second, "compiled": engine.compiled, "warmup_s": warmup_s,
            "shapes": results},
            indent=1))


if __name__ == "__main__":
    main()
