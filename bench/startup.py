"""Start-up time of the two engines, phase by phase, without Ray: what a Talker and a Code2Wav replica do
before they answer /ready (load the checkpoint, size the KV pool, compile, capture graphs, one warm-up
request), with the engine configuration of `configs/high_concurrency.yaml`.

    python -m bench.startup --checkpoint CKPT [--compile-cache-dir DIR] [--profile] [--out startup.json]

Every log line of the engines is kept with its time since the process started, so the JSON says where the
time went (e.g. "compiling fused kernels" -> "captured 17/17 decode graphs"). In a served start the two
replicas load in parallel, each in its own process; here they run one after the other, and `ready_s` of the
served start is about Ray's start-up plus the slower of the two. The Talker's phases include its first-chunk
decoder (a small compiled Code2Wav engine of its own: deployments/talker/first_chunk_decoder.py), as a served
Talker starts it before it is ready. `--profile` adds where the compile time went (bench/compile_profile.py:
the project's Triton kernels' JIT compiles, Inductor's autotuning, Dynamo's phase timers).

For a cold start set TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR to empty directories and give an empty
--compile-cache-dir; for a start "from the cache file" delete those two directories but keep the file.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before torch is imported: the import is part of a replica's start

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.compile_profile import CompileProfile  # noqa: E402
from deployments.talker.first_chunk_decoder import engine_config as first_chunk_config  # noqa: E402
from stages.chunking import ChunkSchedule  # noqa: E402
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig  # noqa: E402
from stages.contract import SamplingParams, SynthesisRequest  # noqa: E402
from stages.prompts import build_prompt  # noqa: E402
from stages.qwen3_tts import Qwen3TTS  # noqa: E402
from stages.talker.engine import TalkerEngine, TalkerEngineConfig  # noqa: E402

IMPORTED_S = time.perf_counter() - T0


class Timeline:
    """A `log` callable that keeps each line with its time since the process started."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def __call__(self, message: str) -> None:
        t = time.perf_counter() - T0
        self.lines.append((round(t, 2), message))
        print(f"[+{t:7.2f} s] {message}", flush=True)

    def mark(self, name: str) -> float:
        self(f"== {name}")
        return self.lines[-1][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--compile-cache-dir", default=None, help="the engine's compile-cache file directory")
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--kv-cache-tokens", type=int, default=262144)
    # a served replica's torch thread count: the application's env_vars set OMP_NUM_THREADS=1 in every shipped config
    # (Ray would set a replica's num_cpus only where it is unset); the compile-cache file is keyed by it
    # (stages/compile_cache.py). To build a served start's cache, `qwen3-tts-serve --prebuild CONFIG` starts the
    # replicas themselves (deployments/launcher/prebuild.py)
    ap.add_argument("--talker-threads", type=int, default=1, help="torch threads while the Talker starts")
    ap.add_argument("--code2wav-threads", type=int, default=1, help="torch threads while Code2Wav starts")
    ap.add_argument("--no-code2wav", action="store_true")
    ap.add_argument("--profile", action="store_true", help="also report where the compile time went")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    profile = CompileProfile().install() if args.profile else None
    log = Timeline()
    log(f"imports done (torch {torch.__version__}) in {IMPORTED_S:.2f} s")
    phases = {"import": IMPORTED_S}

    torch.set_num_threads(args.talker_threads)
    t = log.mark("load talker")
    cuda = torch.cuda.is_available()  # CPU: a smoke run (no compile, no graphs)
    model = Qwen3TTS.load(args.checkpoint, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                          decoder=not args.no_code2wav, voice=True, log=log)
    phases["load_checkpoint"] = log.mark("talker engine start") - t
    t = log.lines[-1][0]
    engine = TalkerEngine(model, TalkerEngineConfig(
        max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len, kv_cache_tokens=args.kv_cache_tokens,
        cuda_graphs=True, compile=True, compile_cache_dir=args.compile_cache_dir))
    engine.start(log)
    phases["talker_engine_start"] = log.mark("talker warm-up request") - t
    t = log.lines[-1][0]
    prompt = build_prompt(model.config, model.tokenizer, "Hello there, this is a start-up test.", speaker="ryan",
                          language="english")

    async def one() -> int:
        stream = engine.add_request(SynthesisRequest("warmup", prompt, SamplingParams(suppress_eos=True),
                                                     max_frames=8))
        return sum([len(c.codes) - c.context async for c in stream])

    frames = asyncio.run(one())
    phases["talker_warmup_request"] = log.mark(f"talker warm-up done ({frames} frames)") - t
    if not args.no_code2wav:
        t = log.lines[-1][0]
        # the schedule of configs/high_concurrency.yaml: first chunk 1 frame, doubling to 25, 25 frames of context
        schedule = ChunkSchedule(first_chunk_frames=1, steady_chunk_frames=25, left_context_frames=25)
        config, _, _ = first_chunk_config(schedule, compile=cuda, compile_cache_dir=args.compile_cache_dir)
        Code2WavEngine(model.decoder, config).warmup(log)
        phases["first_chunk_decoder_start"] = log.mark("first-chunk decoder graphs captured") - t
        torch.set_num_threads(args.code2wav_threads)
        t = log.lines[-1][0]
        c2w = Code2WavEngine(model.decoder, Code2WavEngineConfig(
            max_batch_size=64, max_frames_per_forward=4096, stateful=True, state_slots=576,
            length_buckets=tuple(schedule.graph_lengths(stateful=True)), compile_cache_dir=args.compile_cache_dir))
        c2w.warmup(log)
        phases["code2wav_engine_start"] = log.mark("code2wav graphs captured") - t
    engine.shutdown()
    total = log.lines[-1][0]
    print(json.dumps({k: round(v, 2) for k, v in phases.items()}))
    compile_report = profile.report() if profile else None
    if compile_report:
        print(json.dumps(compile_report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "compile_cache_dir": args.compile_cache_dir,
            "torch_threads": {"talker": args.talker_threads, "code2wav": args.code2wav_threads},
            "phases_s": {k: round(v, 2) for k, v in phases.items()},
            "total_s": total, "compile_profile": compile_report, "timeline": log.lines}, indent=1))


if __name__ == "__main__":
    main()
