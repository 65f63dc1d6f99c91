"""Both engines in one process, without Ray: what the engines alone give a stream, under arrivals.

Closed loop at each concurrency c: c clients each send requests back to back (texts from the load
generator's sentence set, a CustomVoice speaker, fixed length). A request's chunks come from the talker
engine's `ChunkStream` (cut by the serving schedule in the engine loop) and are decoded by one
Code2Wav engine on its own thread, batched like the Code2Wav deployment does (whatever is queued when the
decoder frees up). Per level it reports time to first audio (first chunk decoded), end-to-end latency,
audio-s/s, the share of streams that play gap-free (a real-time player started at the stream's first audio
never falls more than 100 ms behind), the engine's mean step time and batch, and how much of the talker's
engine thread went to prefills (admissions) rather than decode steps. Every frame is checked to hold codes in [0, 2048).

Comparing it with the same levels through `serve run` (bench.loadgen) separates engine limits from
serving overhead.

    python -m bench.pipeline --checkpoint CKPT --levels 1,16,64,256      # GPU
    python -m bench.pipeline --tiny --levels 1,4 --frames 8               # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from bench.loadgen.metrics import continuity
from bench.loadgen.sentences import load_sentences
from stages.chunking import CODEBOOK_SIZE, ChunkSchedule
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.contract import CodecChunk, SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import write_random_checkpoint
from stages.talker.engine import TalkerEngine, TalkerEngineConfig

FRAME_S = 0.08
GAP_FREE_S = 0.1  # a stream is gap-free when its worst playback deficit is at most this (as bench.loadgen)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


class Decoder:
    """One thread owns the Code2Wav engine; chunks queued while it decodes go into the next batch."""

    def __init__(self, engine: Code2WavEngine, executor: ThreadPoolExecutor, max_batch: int):
        self.engine, self.executor, self.max_batch = engine, executor, max_batch
        self.queue: asyncio.Queue = asyncio.Queue()
        self.batches: list[int] = []
        self.task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, chunk: CodecChunk) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((chunk, future))
        return future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and len(items) < self.max_batch:
                items.append(self.queue.get_nowait())
            waves = await loop.run_in_executor(self.executor, self.engine.decode, [c for c, _ in items])
            self.batches.append(len(items))
            for (_, future), wave in zip(items, waves, strict=True):
                if not future.done():
                    future.set_result(wave)


@dataclasses.dataclass
class Record:
    ttfa_s: float
    e2e_s: float
    frames: int
    max_deficit_s: float  # worst playback deficit of a real-time player started at the first audio
    bad_codes: str | None = None


async def one_request(engine: TalkerEngine, decoder: Decoder | None, schedule: ChunkSchedule, prompt,
                      request_id: str, frames: int) -> Record:
    request = SynthesisRequest(request_id, prompt, SamplingParams(suppress_eos=True), max_frames=frames)
    t0 = time.perf_counter()
    arrivals: list[tuple[float, float]] = []  # (time a chunk's audio is ready, its seconds of audio)
    pending: list[asyncio.Future] = []
    got, bad = 0, None

    def ready(chunk: CodecChunk) -> None:
        arrivals.append((time.perf_counter(), chunk.num_new * FRAME_S))

    stream = engine.add_request(request, schedule)  # the engine cuts chunks by the serving schedule
    async for chunk in stream:
        new = chunk.codes[chunk.context:]
        got += len(new)
        out_of_range = (new < 0) | (new >= CODEBOOK_SIZE)
        if out_of_range.any() and bad is None:
            rows, cols = np.nonzero(out_of_range)
            bad = (f"{request_id}: frame {got - len(new) + int(rows[0])} codebook {int(cols[0])} = "
                   f"{int(new[rows[0], cols[0]])} (running {engine.stats().running})")
            print(f"OUT OF RANGE {bad}", flush=True)
        if bad is not None or chunk.num_new == 0:
            continue
        if decoder is None:
            ready(chunk)
        else:
            future = decoder.submit(chunk)
            future.add_done_callback(lambda _f, c=chunk: ready(c))
            pending.append(future)
    if pending:
        await asyncio.gather(*pending)
    end = time.perf_counter()
    arrivals.sort()
    deficit = continuity([t - t0 for t, _ in arrivals], [a for _, a in arrivals]).max_deficit_s if arrivals else 0.0
    return Record(ttfa_s=(arrivals[0][0] if arrivals else end) - t0, e2e_s=end - t0, frames=got,
                  max_deficit_s=deficit, bad_codes=bad)


async def closed_level(engine, decoder, schedule, prompts, c: int, n: int, frames: int, tag: str) -> dict:
    issued = iter(range(n))
    records: list[Record] = []

    async def client() -> None:
        for i in issued:
            records.append(await one_request(engine, decoder, schedule, prompts[i % len(prompts)],
                                             f"{tag}-{i}", frames))

    before = engine.stats()
    batches_before = len(decoder.batches) if decoder else 0
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(c)))
    wall = time.perf_counter() - t0
    after = engine.stats()
    steps = after.steps - before.steps
    ttfa = [r.ttfa_s * 1e3 for r in records]
    e2e = [r.e2e_s * 1e3 for r in records]
    prefill_s = after.prefill_seconds - before.prefill_seconds
    step_s = after.step_seconds - before.step_seconds
    prefills = after.prefills - before.prefills
    dec_batches = decoder.batches[batches_before:] if decoder else []
    return {
        "concurrency": c, "requests": len(records), "frames_per_request": frames,
        "ttfa_ms": {"p50": pct(ttfa, 50), "p95": pct(ttfa, 95), "max": max(ttfa)},
        "e2e_ms": {"p50": pct(e2e, 50), "p95": pct(e2e, 95)},
        "audio_s_per_s": sum(r.frames for r in records) * FRAME_S / wall,
        "gap_free_share": sum(r.max_deficit_s <= GAP_FREE_S for r in records) / max(len(records), 1),
        "max_deficit_ms": {"p50": pct([r.max_deficit_s * 1e3 for r in records], 50),
                           "p95": pct([r.max_deficit_s * 1e3 for r in records], 95)},
        "steps": steps, "mean_batch": (after.frames - before.frames) / max(steps, 1),
        "step_ms": step_s / max(steps, 1) * 1e3,
        "prefills": prefills, "prefill_ms": prefill_s / max(prefills, 1) * 1e3,
        "prefill_share": prefill_s / wall, "step_share": step_s / wall,
        "decode_batches": len(dec_batches), "mean_decode_batch": statistics.fmean(dec_batches) if dec_batches else 0,
        "bad_codes": [r.bad_codes for r in records if r.bad_codes],
        "wall_s": wall,
    }


async def run(args, model: Qwen3TTS, device: str) -> list[dict]:
    speaker = sorted(model.config.talker.speakers)[0]
    prompts = [build_prompt(model.config, model.tokenizer, s.text, speaker=speaker) for s in load_sentences()]
    schedule = ChunkSchedule(first_chunk_frames=args.first_chunk_frames, left_context_frames=args.left_context)
    engine = TalkerEngine(model, TalkerEngineConfig(
        max_num_seqs=args.slots, max_seq_len=args.max_seq_len, kv_cache_tokens=args.kv_tokens,
        cuda_graphs=not args.no_graphs, compile=args.compile, schedule=schedule))
    t0 = time.perf_counter()
    await asyncio.to_thread(engine.start, print)
    print(f"talker engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    decoder = None
    # the decoder thread gets its own CUDA stream (current streams are per thread): sharing the default stream
    # would serialize talker steps behind decodes, which separate processes (the deployments) never do
    executor = ThreadPoolExecutor(1, thread_name_prefix="code2wav", initializer=_own_stream if device == "cuda" else None)
    if not args.no_code2wav:
        loop = asyncio.get_running_loop()
        config = Code2WavEngineConfig.for_schedule(schedule, max_batch_size=args.decode_batch,
                                                   cuda_graphs=not args.no_graphs, stateful=args.stateful_code2wav,
                                                   state_slots=max(args.slots, 1))
        c2w = await loop.run_in_executor(executor, Code2WavEngine, model.decoder, config)
        await loop.run_in_executor(executor, c2w.warmup, print)
        decoder = Decoder(c2w, executor, args.decode_batch)
    # warm-up: every prompt once (prefill shapes), at a moderate concurrency
    warm = await closed_level(engine, decoder, schedule, prompts, min(16, args.slots), len(prompts), 4, "warm")
    print(f"warm-up: {warm['requests']} requests in {warm['wall_s']:.1f} s", flush=True)
    results = []
    for c in [int(x) for x in args.levels.split(",")]:
        n = max(args.min_requests, args.per_level * c)
        r = await closed_level(engine, decoder, schedule, prompts, c, n, args.frames, f"c{c}")
        results.append(r)
        print(row(r), flush=True)
    engine.shutdown()
    executor.shutdown(wait=True)
    return results


def _own_stream() -> None:
    # high priority: a chunk's decode is what a listener waits for; talker kernels queued meanwhile wait instead
    torch.cuda.set_stream(torch.cuda.Stream(priority=-1 if DECODE_PRIORITY else 0))


DECODE_PRIORITY = True


HEADER = ("| c | requests | TTFA p50 / p95 / max (ms) | E2E p50 / p95 (ms) | audio-s/s | gap-free | mean batch | "
          "step ms | prefills, ms each | prefill / step share of wall | decode batches, mean size | bad codes |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def row(r: dict) -> str:
    t, e = r["ttfa_ms"], r["e2e_ms"]
    return (f"| {r['concurrency']} | {r['requests']} | {t['p50']:.1f} / {t['p95']:.1f} / {t['max']:.1f} | "
            f"{e['p50']:.0f} / {e['p95']:.0f} | {r['audio_s_per_s']:.1f} | {r['gap_free_share']:.0%} | "
            f"{r['mean_batch']:.1f} | "
            f"{r['step_ms']:.2f} | {r['prefills']}, {r['prefill_ms']:.2f} | "
            f"{r['prefill_share']:.0%} / {r['step_share']:.0%} | {r['decode_batches']}, "
            f"{r['mean_decode_batch']:.1f} | {len(r['bad_codes'])} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: a random one under --workdir)")
    ap.add_argument("--size", default="1.7b", choices=["0.6b", "1.7b"])
    ap.add_argument("--workdir", default="/tmp/qwen3-tts-bench")
    ap.add_argument("--tiny", action="store_true", help="tiny random checkpoint (CPU smoke run)")
    ap.add_argument("--levels", default="1,16,64,256")
    ap.add_argument("--per-level", type=int, default=2, help="requests per level: max(min, k x c)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--frames", type=int, default=75, help="frames per request (75 = 6 s)")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--kv-tokens", type=int, default=262144, help="KV pool (positions, all requests)")
    ap.add_argument("--first-chunk-frames", type=int, default=2)
    ap.add_argument("--left-context", type=int, default=25)
    ap.add_argument("--decode-batch", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="torch.compile the talker's layer math and sampling")
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-code2wav", action="store_true", help="talker only (first audio = first chunk cut)")
    ap.add_argument("--stateful-code2wav", action="store_true",
                    help="Code2Wav carries each stream's decoder state (decodes new frames only)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--decode-priority", choices=["high", "normal"], default="high",
                    help="CUDA stream priority of the Code2Wav thread")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args()
    global DECODE_PRIORITY
    DECODE_PRIORITY = args.decode_priority == "high"

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = Path(args.workdir) / f"{args.size}-custom_voice{'-tiny' if args.tiny else ''}"
        if not (Path(ckpt) / "config.json").exists():
            write_random_checkpoint(ckpt, args.size, "custom_voice", tiny=args.tiny, dtype=dtype, device=device)
    model = Qwen3TTS.load(ckpt, device=device, dtype=dtype, decoder=not args.no_code2wav, voice=False, log=print)
    results = asyncio.run(run(args, model, device))
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    print(f"\n{name}, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"`python {shlex.join(sys.argv)}`\n\n{HEADER}")
    for r in results:
        print(row(r))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": name, "command": shlex.join(sys.argv), "torch": torch.__version__,
                                              "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d}", "results": results},
                                             indent=1))


if __name__ == "__main__":
    main()
