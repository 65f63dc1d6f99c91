"""Talker engine micro-benchmark: ms per decode step and frames/s by batch size, graph vs eager check.

    python bench/talker.py --size 1.7b --batches 1,8,32,64,128,256,512 --steps 50 --out bench/out/talker_1.7b.json

Builds a full-size random checkpoint (real shapes) when --checkpoint is not given, loads it in bf16,
admits B requests (fixed length: EOS suppressed) and times decode steps of the whole batch, each
step = code predictor (15 passes) + talker step + sampling + one device-to-host copy of the codes.
With --check-graphs it also runs the same steps eagerly from the same state and compares codes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.contract import SamplingParams  # noqa: E402
from stages.model import Qwen3TTS  # noqa: E402
from stages.prompts import build_prompt  # noqa: E402
from stages.random_checkpoint import write_random_checkpoint  # noqa: E402
from stages.sampling import mask_talker_logits, select_tokens  # noqa: E402
from stages.talker.prefill import build_prefill  # noqa: E402
from stages.talker.runner import TalkerRunner  # noqa: E402

# bf16 weight bytes read per frame at batch 1 (research brief §8) and the H100's ~3.0 TB/s
FLOOR_MS = {"0.6b": 1.10, "1.7b": 1.77}
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest."


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def admit(runner: TalkerRunner, model: Qwen3TTS, b: int, sampling: SamplingParams) -> None:
    prompt = build_prompt(model.config, model.tokenizer, TEXT, speaker=next(iter(model.config.talker.speakers), None)
                          if model.config.model_kind == "custom_voice" else None, language="english",
                          instruct="A calm voice." if model.config.model_kind == "voice_design" else None)
    embeds = build_prefill(model.talker, model.config, prompt)
    for start in range(0, b, 16):
        n = min(16, b - start)
        runner.prefill(start, [embeds] * n, [sampling] * n, list(range(start, start + n)))


def time_steps(runner: TalkerRunner, bucket: int, attn_len: int, steps: int) -> tuple[float, list[torch.Tensor]]:
    outs = []
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        outs.append(runner.decode(bucket, attn_len).clone())
    return (time.perf_counter() - t0) / steps * 1e3, outs


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
    ap.add_argument("--compile", action="store_true", help="torch.compile the layer math and sampling")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--out", default=None, help="JSON results path")
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
    runner = TalkerRunner(model, max(batches), args.max_seq_len, 64, (128, 256, 512, 1024), compile=args.compile)
    capture_s = 0.0
    if device == "cuda" and not args.no_graphs:
        capture_s = runner.capture_graphs(tuple(batches), log=print)
    prefill_ms = {}
    for n in (1, 16):  # eager batched prefill of n requests (+ first-token sampling), the admission cost
        if n <= max(batches):
            admit(runner, model, n, sampling)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                admit(runner, model, n, sampling)
                runner.first_tokens(0, n)  # the engine's one host sync per admission
            prefill_ms[n] = round((time.perf_counter() - t0) / 5 * 1e3, 2)
    print(f"prefill (prompt of {int(runner.positions[0])} positions): {prefill_ms} ms for batches {list(prefill_ms)}")
    results = []
    for b in batches:
        admit(runner, model, b, sampling)
        prompt_len = int(runner.positions[0])
        attn_len = runner.attn_bucket(prompt_len + args.steps * 2 + 2)
        time_steps(runner, b, attn_len, 3)  # warm up
        saved = [t.clone() for t in runner._slot_tensors()]
        ms, outs = time_steps(runner, b, attn_len, args.steps)
        row = {"batch": b, "ms_per_step": round(ms, 3), "frames_per_s": round(b * 1000 / ms, 1),
               "audio_s_per_s": round(b * 1000 / ms * 0.08, 1), "x_realtime_per_stream": round(80 / ms, 1),
               "attn_len": attn_len}
        if args.check_graphs and runner.graphs:
            for t, s in zip(runner._slot_tensors(), saved, strict=True):
                t.copy_(s)
            # the reference: plain eager PyTorch (no graph, no compiled kernels)
            graphs, runner.graphs = runner.graphs, {}
            kernels, select, mask = runner.talker.model.kernels, runner._select, runner._mask
            runner.talker.model.kernels = runner.talker.code_predictor.model.kernels = None
            runner._select, runner._mask = select_tokens, mask_talker_logits
            _, eager = time_steps(runner, b, attn_len, args.steps)
            runner.graphs = graphs
            runner.talker.model.kernels = runner.talker.code_predictor.model.kernels = kernels
            runner._select, runner._mask = select, mask
            same = sum(bool(torch.equal(g, e)) for g, e in zip(outs, eager, strict=True))
            row["graph_equals_eager_steps"] = f"{same}/{args.steps}"
            diff = [i for i, (g, e) in enumerate(zip(outs, eager, strict=True)) if not torch.equal(g, e)]
            row["first_differing_step"] = diff[0] if diff else None
        results.append(row)
        print(json.dumps(row), flush=True)
    report = {
        "device": device_name(), "date": datetime.date.today().isoformat(), "command": " ".join(sys.argv),
        "size": args.size, "kind": args.kind, "dtype": args.dtype, "graphs": bool(runner.graphs),
        "compile": args.compile,
        "graph_capture_s": round(capture_s, 1), "bandwidth_floor_ms_b1": FLOOR_MS.get(args.size),
        "prefill_ms": prefill_ms,
        "torch": torch.__version__, "results": results,
    }
    print(f"\n{report['device']}  {args.size} {args.kind} {args.dtype}  graphs={report['graphs']}  "
          f"compile={args.compile}  "
          f"capture {capture_s:.1f} s  ({report['date']})")
    print("| batch | ms/step | frames/s | audio-s/s | x real time per stream |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['batch']} | {r['ms_per_step']} | {r['frames_per_s']} | {r['audio_s_per_s']} | "
              f"{r['x_realtime_per_stream']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
