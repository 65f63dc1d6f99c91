"""What word timestamps cost: Qwen3-ForcedAligner milliseconds per second of audio timed, by batch size.

Loads an aligner checkpoint (`--checkpoint`), or writes a random-weight one of the released 0.6B shapes (`--tiny`:
the test shapes) into `--workdir` once: the cost does not depend on the weights. Each piece is `--seconds` of
24 kHz audio (what the served speech is) with `--words-per-second` words of text; a batch of N pieces is N
`prepare_piece` calls and one `align_prepared` forward, as AlignerServer makes them (deployments/aligner/server.py).
Per batch size, the median over `--repeats` batches after `--warmup` of:

- `prepare_ms_per_audio_s`: the host's work per piece (resampling, normalizing, tokenizing) on one thread: what the
  replica's preparing threads spend, beside the forwards;
- `device_thread_ms_per_audio_s`: the forward call (log-mel, forward, timestamps), device synchronized: what the
  replica's one device thread spends per second of speech it times, which bounds the audio one replica can time;
- `aligner_ms_per_audio_s`: the two together (one piece alone, start to end);
- `forward_ms_per_audio_s`: the model's forward alone, timed on the device (CUDA events; wall time on a CPU): what a
  GPU shared with the Talker and Code2Wav gives up per second of speech.

`--profile N` adds where the GPU time of one forward of N pieces goes: its kernels (eager, so that each is seen) by
kind (GEMM, attention, convolution, norm, elementwise/copy) with counts and milliseconds, and the ten costliest.

Prints one JSON object (also written to `--out`).

    python -m bench.aligner_cost                                # CUDA, bf16, 0.6B random weights, batches 1/8/32
    python -m bench.aligner_cost --checkpoint ~/Qwen3-ForcedAligner-0.6B
    python -m bench.aligner_cost --tiny --device cpu            # CPU smoke run (tests/bench)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from stages.aligner import Aligner
from stages.aligner.random_checkpoint import write_random_aligner
from stages.contract import SAMPLE_RATE


def checkpoint(args: argparse.Namespace, dtype: str) -> Path:
    """The aligner to time: `--checkpoint`, else a random one of the chosen shapes, written once under `--workdir`."""
    if args.checkpoint:
        return Path(args.checkpoint).expanduser()
    out = Path(args.workdir) / f"aligner-{'tiny' if args.tiny else '06b'}-{dtype}"
    if not (out / "config.json").exists():
        write_random_aligner(out, tiny=args.tiny, dtype=dtype, device=args.device, log=lambda m: print(m, flush=True))
    return out


def pieces(n: int, seconds: float, words_per_second: float, seed: int = 0) -> tuple[list[np.ndarray], list[str]]:
    rng = np.random.default_rng(seed)
    audio = [(0.1 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.float32) for _ in range(n)]
    words = max(1, round(seconds * words_per_second))
    texts = [" ".join(f"word{(i * 7 + j) % 97}" for j in range(words)) for i in range(n)]
    return audio, texts


class ForwardTimer:
    """Device time of each `aligner.logits` call (CUDA events), or its wall time on a CPU."""

    def __init__(self, aligner: Aligner):
        self.aligner, self.ms = aligner, []
        self._logits = aligner.logits
        aligner.logits = self  # instance attribute: Aligner.align calls self.logits(batch)

    def __call__(self, batch):
        if self.aligner.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = self._logits(batch)
            end.record()
            end.synchronize()
            self.ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = self._logits(batch)
            self.ms.append((time.perf_counter() - t0) * 1000)
        return out


def sync(aligner: Aligner) -> None:
    if aligner.device.type == "cuda":
        torch.cuda.synchronize(aligner.device)


def measure(aligner: Aligner, timer: ForwardTimer, batch: int, args: argparse.Namespace) -> dict[str, float]:
    audio, texts = pieces(batch, args.seconds, args.words_per_second)
    audio_s = batch * args.seconds
    for _ in range(args.warmup):
        aligner.align(audio, texts, SAMPLE_RATE)
    sync(aligner)
    timer.ms.clear()
    prepare, device_thread = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        prepared = [aligner.prepare_piece(a, t, SAMPLE_RATE) for a, t in zip(audio, texts, strict=True)]
        t1 = time.perf_counter()
        aligner.align_prepared(prepared)
        sync(aligner)
        prepare.append((t1 - t0) * 1000)
        device_thread.append((time.perf_counter() - t1) * 1000)
    return {"prepare_ms_per_audio_s": statistics.median(prepare) / audio_s,
            "device_thread_ms_per_audio_s": statistics.median(device_thread) / audio_s,
            "forward_ms_per_audio_s": statistics.median(timer.ms) / audio_s}


KINDS = (("attention", ("fmha", "attention", "flash")), ("conv", ("conv", "winograd", "implicit_gemm", "cudnn")),
         ("gemm", ("gemm", "cutlass", "nvjet", "cublas", "sm90_xmma", "aten::mm", "aten::addmm", "aten::bmm")),
         ("norm", ("layer_norm", "rms", "norm")))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "elementwise/copy")


def profile(aligner: Aligner, batch: int, args: argparse.Namespace) -> dict:
    """One eager forward of `batch` pieces under torch.profiler: its CUDA kernels by kind and the ten costliest (on a
    CPU: its operators' own times)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    audio, texts = pieces(batch, args.seconds, args.words_per_second)
    prepared = aligner.batch([aligner.prepare_piece(a, t, SAMPLE_RATE) for a, t in zip(audio, texts, strict=True)])
    runners, aligner.runners = aligner.runners, None
    try:
        for _ in range(2):
            aligner.logits(prepared)
        sync(aligner)
        cuda = aligner.device.type == "cuda"
        with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            aligner.logits(prepared)
            sync(aligner)
    finally:
        aligner.runners = runners
    kinds: dict[str, dict[str, float]] = {}
    top: dict[str, float] = {}
    for event in prof.events():
        if cuda and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = (event.device_time if cuda else event.self_cpu_time_total) / 1000
        entry = kinds.setdefault(kernel_kind(event.name), {"kernels": 0, "ms": 0.0})
        entry["kernels"] += 1
        entry["ms"] += ms
        top[event.name[:90]] = top.get(event.name[:90], 0.0) + ms
    return {"batch": batch, "prompt_positions": list(prepared.input_ids.shape),
            ("gpu_ms" if cuda else "cpu_ms"): round(sum(k["ms"] for k in kinds.values()), 3),
            "by_kind": {k: {"kernels": v["kernels"], "ms": round(v["ms"], 3)} for k, v in
                        sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])},
            "top": {name: round(ms, 3) for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:10]}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.aligner_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="an aligner checkpoint (default: a random one written to --workdir)")
    parser.add_argument("--tiny", action="store_true", help="random weights of the test shapes (CPU smoke runs)")
    parser.add_argument("--workdir", default="/tmp/aligner_cost")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batches", default="1,8,32", help="batch sizes, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="audio seconds per piece")
    parser.add_argument("--words-per-second", type=float, default=2.5, help="words of text per audio second")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--profile", type=int, default=None, help="also profile one eager forward of this many pieces")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    path = checkpoint(args, dtype)
    t0 = time.perf_counter()
    aligner = Aligner.load(path, args.device, dtype)
    load_s = time.perf_counter() - t0
    timer = ForwardTimer(aligner)
    batches = [int(b) for b in args.batches.split(",")]
    rows = {b: measure(aligner, timer, b, args) for b in batches}
    result = {
        "bench": "aligner_cost",
        "checkpoint": str(path),
        "shapes": "tiny" if args.tiny and not args.checkpoint else "checkpoint" if args.checkpoint else "0.6b",
        "device": torch.cuda.get_device_name(aligner.device) if aligner.device.type == "cuda" else platform.processor()
        or "cpu",
        "dtype": dtype,
        "piece_seconds": args.seconds,
        "words_per_second": args.words_per_second,
        "repeats": args.repeats,
        "load_s": round(load_s, 2),
        "aligner_ms_per_audio_s": {str(b): round(r["prepare_ms_per_audio_s"] + r["device_thread_ms_per_audio_s"], 4)
                                   for b, r in rows.items()},
        "prepare_ms_per_audio_s": {str(b): round(r["prepare_ms_per_audio_s"], 4) for b, r in rows.items()},
        "device_thread_ms_per_audio_s": {str(b): round(r["device_thread_ms_per_audio_s"], 4) for b, r in rows.items()},
        "forward_ms_per_audio_s": {str(b): round(r["forward_ms_per_audio_s"], 4) for b, r in rows.items()},
    }
    if args.profile:
        result["profile"] = profile(aligner, args.profile, args)
    if aligner.device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(aligner.device) / 2**30, 2)
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
