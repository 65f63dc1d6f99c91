"""Talker engine micro-benchmark: ms per decode step and frames/s by batch size, graph vs eager check.

    python -m bench.talker --size 1.7b --batches 1,8,32,64,128,256,512 --steps 50 --out bench/out/talker_1.7b.json

Builds a full-size random checkpoint (real shapes) when --checkpoint is not given, loads it in bf16,
admits B requests (fixed length: EOS suppressed) and times decode steps of the whole batch, each
step = code predictor (15 passes) + talker step + sampling + one device-to-host copy of the codes. Two timings:
`ms_per_step`, each step read back before the next is launched (the device idles while the host reads and
launches), and `ms_per_step_overlapped`, the next step launched before the previous one is read, as the engine's
loop runs them (what a stream's frames take in the engine).
With --check-graphs it also runs the same steps eagerly from the same state and compares codes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.kernel_flags import add_kernel_flags, kernel_kwargs
from stages.contract import NUM_CODEBOOKS, SamplingParams
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import write_random_checkpoint
from stages.talker import cuda_graphs
from stages.talker.compiled import EAGER_STEP_FUNCTIONS
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.prompt_plan import plan_prompt
from stages.talker.runner import Admission, TalkerRunner

# bf16 weight bytes read per frame at batch 1 (research brief §8) and the H100's ~3.0 TB/s
FLOOR_MS = {"0.6b": 1.10, "1.7b": 1.77}
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def prompt_plan(model: Qwen3TTS):
    prompt = build_prompt(model.config, model.tokenizer, TEXT, speaker=next(iter(model.config.talker.speakers), None)
                          if model.config.model_kind == "custom_voice" else None, language="english",
                          instruct="A calm voice." if model.config.model_kind == "voice_design" else None)
    return plan_prompt(model.config, prompt)


def admit(runner: TalkerRunner, plan, b: int, sampling: SamplingParams, blocks_per_request: int) -> None:
    """Rows [0, b) take the same prompt, in prefills as large as the runner holds (as the engine packs them)."""
    start = 0
    while start < b:
        n = 1
        while start + n < b and runner.prefill_fits(n + 1, plan.length):
            n += 1
        runner.admit([Admission(r, plan, sampling, r, np.arange(r * blocks_per_request, (r + 1) * blocks_per_request))
                      for r in range(start, start + n)])
        start += n


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextlib.contextmanager
def eager_reference(runner: TalkerRunner, on: bool = True):
    """Inside: the reference path, plain eager PyTorch (no graph, no compiled kernels)."""
    if not on:
        yield
        return
    graphs, runner.graphs = runner.graphs, {}
    kernels, compiled = runner.talker.model.kernels, {name: getattr(runner, name) for name in EAGER_STEP_FUNCTIONS}
    runner.talker.model.kernels = runner.talker.code_predictor.model.kernels = None
    for name, fn in EAGER_STEP_FUNCTIONS.items():
        setattr(runner, name, fn)
    try:
        yield
    finally:
        runner.graphs = graphs
        runner.talker.model.kernels = runner.talker.code_predictor.model.kernels = kernels
        for name, fn in compiled.items():
            setattr(runner, name, fn)


def time_steps(runner: TalkerRunner, bucket: int, attn_len: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    """Decode steps one after the other, each read back before the next (no overlap: the decode-only step)."""
    outs = []
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        turn = runner.launch_step(bucket, attn_len)
        outs.append(torch.from_numpy(runner.step_output(turn, bucket).copy()))
    return (time.perf_counter() - t0) / steps * 1e3, outs


def time_steps_overlapped(runner: TalkerRunner, bucket: int, attn_len: int, steps: int) -> float:
    """ms per step the way TalkerEngine runs them: step N+1 launched before step N is read (the runner's two
    output buffers), so the host's read-back and launch of the next graph overlap the device's work."""
    sync()
    t0 = time.perf_counter()
    turn = runner.launch_step(bucket, attn_len)
    for _ in range(steps - 1):
        following = runner.launch_step(bucket, attn_len)
        runner.step_output(turn, bucket)
        turn = following
    runner.step_output(turn, bucket)
    return (time.perf_counter() - t0) / steps * 1e3


def profile_steps(runner: TalkerRunner, bucket: int, attn_len: int, step_ms: float, out: str | None,
                  steps: int = 10) -> dict:
    """Kernels per step, their summed device time per step (busy) against the step's wall time, top kernels.

    Wall minus busy is time the GPU waited between kernels: launch boundaries inside the graphs and the host's
    read-back between steps."""
    return profile_calls(lambda: time_steps(runner, bucket, attn_len, steps), steps, step_ms, f"batch {bucket}",
                         out and str(Path(out).with_name(f"{Path(out).stem}_profile_b{bucket}.txt")))


def profile_calls(run, calls: int, wall_ms: float, label: str, table_path: str | None) -> dict:
    """The CUDA kernels of `run()` (which makes `calls` calls of what is profiled): per call, their number,
    summed device time and the top ones; the whole table to `table_path`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in events)
    kernels = sum(e.count for e in events if not e.key.startswith("Memcpy") and not e.key.startswith("Memset"))
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    summary = {"kernels_per_call": round(kernels / calls), "busy_ms_per_call": round(total_us / calls / 1e3, 3),
               "wall_ms_per_call": round(wall_ms, 3),
               "top": [{"kernel": e.key[:90], "ms_per_call": round(e.self_device_time_total / calls / 1e3, 3),
                        "calls_per_call": round(e.count / calls, 1)} for e in top]}
    print(f"profile {label}: {summary['kernels_per_call']} kernels per call, GPU busy "
          f"{summary['busy_ms_per_call']} of {wall_ms:.2f} ms", flush=True)
    for t in summary["top"]:
        print(f"   {t['ms_per_call']:7.3f} ms  x{t['calls_per_call']:>6}  {t['kernel']}", flush=True)
    if table_path:
        Path(table_path).parent.mkdir(parents=True, exist_ok=True)
        Path(table_path).write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=50,
                                                                  max_name_column_width=160))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: build a random one under --workdir)")
    ap.add_argument("--size", default="1.7b", choices=["0.6b", "1.7b"])
    ap.add_argument("--kind", default="custom_voice")
    ap.add_argument("--workdir", default="/tmp/qwen3-tts-bench")
    ap.add_argument("--batches", default="1,8,32,64,128,256,512")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--max-seq-len", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--greedy", action="store_true", help="greedy instead of the default sampling parameters")
    ap.add_argument("--check-graphs", action="store_true", help="compare graph replay with eager steps")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-kernel", action="store_true", help="gather + SDPA decode attention instead of the paged kernel")
    ap.add_argument("--compile", action="store_true", help="torch.compile the layer math and sampling")
    add_kernel_flags(ap)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", default=None, help="JSON results path")
    ap.add_argument("--profile", action="store_true",
                    help="per batch: torch profiler over 10 steps: kernels per step, GPU busy time, top kernels")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = Path(args.workdir) / f"{args.size}-{args.kind}{'-tiny' if args.tiny else ''}"
        if not (ckpt / "config.json").exists():
            write_random_checkpoint(ckpt, args.size, args.kind, tiny=args.tiny, dtype=args.dtype, device=device)
    model = Qwen3TTS.load(ckpt, device=device, dtype=args.dtype, decoder=False, voice=False, log=print)
    batches = [int(x) for x in args.batches.split(",")]
    sampling = (SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True) if args.greedy
                else SamplingParams(suppress_eos=True))
    plan = prompt_plan(model)
    per_request = -(-(plan.length + 2 * args.steps + 8) // 16)  # KV blocks: prompt + timed and warm-up steps
    config = TalkerEngineConfig(max_num_seqs=max(batches), max_seq_len=args.max_seq_len, max_text_rows=64,
                                compile=args.compile, **kernel_kwargs(
                                    args, attention_kernel=None if not args.no_kernel else False))
    runner = TalkerRunner(model, config, num_blocks=max(batches) * per_request)
    capture_s = 0.0
    if device == "cuda" and not args.no_graphs:
        capture_s = cuda_graphs.capture(runner, tuple(batches), log=print)
    prefill_ms = {}
    for n in (1, 16):  # one admission batch of n requests: host time to launch it, and until the device is done
        if n <= max(batches):
            admit(runner, plan, n, sampling, per_request)
            sync()
            t0 = time.perf_counter()
            admit(runner, plan, n, sampling, per_request)
            launched = time.perf_counter()
            sync()
            prefill_ms[n] = {"host": round((launched - t0) * 1e3, 3), "device": round((time.perf_counter() - t0) * 1e3, 2)}
    print(f"prefill (prompt of {plan.length} positions, graphed={bool(runner.prefill_graphs)}): {prefill_ms}")
    if args.profile and device == "cuda":
        for n, times in prefill_ms.items():
            table = args.out and str(Path(args.out).with_name(f"{Path(args.out).stem}_profile_prefill{n}.txt"))
            times["profile"] = profile_calls(
                lambda n=n: [admit(runner, plan, n, sampling, per_request) for _ in range(5)], 5, times["device"],
                f"prefill of {n}", table)
    results = []
    for b in batches:
        admit(runner, plan, b, sampling, per_request)
        attn_len = runner.attn_bucket(plan.length + args.steps * 2 + 2)
        time_steps(runner, b, attn_len, 3)  # warm up
        saved = [t.clone() for t in runner._row_tensors()]
        ms, outs = time_steps(runner, b, attn_len, args.steps)
        overlapped_ms = time_steps_overlapped(runner, b, attn_len, args.steps)
        row = {"batch": b, "ms_per_step": round(ms, 3), "frames_per_s": round(b * 1000 / ms, 1),
               "audio_s_per_s": round(b * 1000 / ms * 0.08, 1), "x_realtime_per_stream": round(80 / ms, 1),
               "ms_per_step_overlapped": round(overlapped_ms, 3),
               "audio_s_per_s_overlapped": round(b * 1000 / overlapped_ms * 0.08, 1), "attn_len": attn_len}
        if args.check_graphs and runner.graphs:
            # the first step from the same state, graphed then eager: the talker's codebook-0 logits (from the
            # hidden state the step leaves) and the frame's codes, before sampled codes make the paths diverge
            first = {}
            for path in ("graph", "eager"):
                for t, s in zip(runner._row_tensors(), saved, strict=True):
                    t.copy_(s)
                with eager_reference(runner, on=path == "eager"):
                    turn = runner.launch_step(b, attn_len)
                    codes = torch.from_numpy(runner.step_output(turn, b).copy())
                    first[path] = (runner.talker.codec_logits(runner.hidden[:b]).float(), codes)
            (lg, cg), (le, ce) = first["graph"], first["eager"]
            same_codes = (cg[:, :NUM_CODEBOOKS] == ce[:, :NUM_CODEBOOKS]).all(dim=1)  # rows whose inputs agree
            row["first_step_codes_equal"] = round((cg[:, :NUM_CODEBOOKS] == ce[:, :NUM_CODEBOOKS]).float().mean().item(), 4)
            row["first_step_rows_all_codes_equal"] = int(same_codes.sum())
            if same_codes.any():  # the logit error of the arithmetic alone (a sampled code that differs changes the input)
                rows = same_codes.to(lg.device)
                row["first_step_logit_max_abs_err"] = round((lg[rows] - le[rows]).abs().max().item(), 4)
                row["first_step_logit_max_abs"] = round(le[rows].abs().max().item(), 3)
            for t, s in zip(runner._row_tensors(), saved, strict=True):
                t.copy_(s)
            with eager_reference(runner):
                _, eager = time_steps(runner, b, attn_len, args.steps)
            same = sum(bool(torch.equal(g, e)) for g, e in zip(outs, eager, strict=True))
            row["graph_equals_eager_steps"] = f"{same}/{args.steps}"
            diff = [i for i, (g, e) in enumerate(zip(outs, eager, strict=True)) if not torch.equal(g, e)]
            row["first_differing_step"] = diff[0] if diff else None
        if args.profile and device == "cuda":
            row["profile"] = profile_steps(runner, b, attn_len, ms, args.out)
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "device": device_name(), "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
        "size": args.size, "kind": args.kind, "dtype": args.dtype, "graphs": bool(runner.graphs),
        "compile": args.compile, "paged_attention_kernel": runner.use_kernel,
        "gemv_rows": runner.gemv_rows, "pdl": runner.pdl,
        "heads_in_attention": runner.heads_in_attention, "sampling_kernel": runner.sampling_kernel,
        "attention_splits": runner.attention_splits,
        "graph_capture_s": round(capture_s, 1), "bandwidth_floor_ms_b1": FLOOR_MS.get(args.size),
        "prefill_ms": prefill_ms,
        "torch": torch.__version__, "results": results,
    }
    print(f"\n{report['device']}  {args.size} {args.kind} {args.dtype}  graphs={report['graphs']}  "
          f"compile={args.compile}  "
          f"capture {capture_s:.1f} s  ({report['date']})")
    print("| batch | ms/step | frames/s | audio-s/s | x real time per stream | ms/step, next launched before the read |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['batch']} | {r['ms_per_step']} | {r['frames_per_s']} | {r['audio_s_per_s']} | "
              f"{r['x_realtime_per_stream']} | {r['ms_per_step_overlapped']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
