"""Both engines in one process, without Ray: what the engines alone give a stream, under arrivals.

Closed loop at each concurrency c: c clients each send requests back to back (texts from the load
generator's sentence set, a CustomVoice speaker, fixed length). A request's chunks come from the talker
engine's `ChunkStream` (cut by the serving schedule in the engine loop) and are decoded by one
Code2Wav engine on its own thread, batched like the Code2Wav deployment does (whatever is queued when the
decoder frees up). Per level it reports time to first audio (first chunk decoded), end-to-end latency,
audio-s/s, the share of streams that play gap-free (a real-time player started at the stream's first audio
never falls more than 100 ms behind), the engine's mean step time and batch, and how much of the talker's
engine thread went to prefills (admissions) rather than decode steps. Every frame is checked to hold codes in [0, 2048).

For each stream that gapped it reports the chunk of its worst deficit, how long that chunk waited from its
cut to its audio, and the talker's time per frame of that stream up to it; each level's JSON also holds a
timeline of the engine's counters (every 20 ms) and the decoder's calls. `--decode-policies` runs several
ways of taking queued chunks in turn on the same engines (order fifo or earliest playback deadline, chunks
and frames per call, CUDA stream priority; measured alike on an H100, docs/benchmarks.md), `--ramps`
several chunk ramps.

Comparing it with the same levels through `serve run` (bench.loadgen) separates engine limits from
serving overhead. `--stagger-s S` spreads the c clients' starts over S seconds (client k of c starts k x S / c
into the level), as bench.loadgen's `--stagger-s` does: arrivals of listeners rather than one burst.

    python -m bench.pipeline --checkpoint CKPT --levels 1,16,64,256      # GPU
    python -m bench.pipeline --tiny --levels 1,4 --frames 8               # CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as dt
import heapq
import itertools
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

from bench.kernel_flags import add_kernel_flags, kernel_kwargs
from bench.loadgen.metrics import continuity
from bench.loadgen.runner import stream_start_s
from bench.loadgen.sentences import load_sentences
from stages.chunking import CODEBOOK_SIZE, ChunkSchedule
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.contract import CodecChunk, SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import write_random_checkpoint
from stages.talker import step_clock
from stages.talker.engine import TalkerEngine, TalkerEngineConfig

FRAME_S = 0.08
GAP_FREE_S = 0.1  # a stream is gap-free when its worst playback deficit is at most this (as bench.loadgen)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclasses.dataclass(frozen=True)
class DecodePolicy:
    """How the decoder thread takes queued chunks: in arrival order ("fifo") or earliest playback deadline
    first ("deadline": when the stream's real-time player reaches the chunk), at most `max_chunks` and `max_frames` (0: no
    limit) per engine call, on a CUDA stream of `priority` ("high": a decode's kernels go before the
    talker's queued ones; "normal": the talker's priority; "shared": no stream of its own, so decodes and
    talker steps serialize on the default stream and never overlap, as two processes time-slicing a GPU)."""

    order: str = "deadline"
    max_chunks: int = 256
    max_frames: int = 2048
    priority: str = "high"

    @classmethod
    def parse(cls, text: str) -> DecodePolicy:  # "deadline:256:2048[:normal]"
        order, chunks, frames, *priority = text.split(":")
        if order not in ("fifo", "deadline") or priority not in ([], ["high"], ["normal"], ["shared"]):
            raise ValueError(f"a decode policy is fifo|deadline:CHUNKS:FRAMES[:high|normal|shared], got {text!r}")
        return cls(order, int(chunks), int(frames), *priority)

    def __str__(self) -> str:
        return f"{self.order}:{self.max_chunks}:{self.max_frames}:{self.priority}"


class Decoder:
    """One thread owns the Code2Wav engine; chunks queued while it decodes go into the next call, taken by
    the policy (as many as it allows). `calls` records (start, end, chunks, frames) of each engine call."""

    def __init__(self, engine: Code2WavEngine, executor: ThreadPoolExecutor, policy: DecodePolicy):
        self.engine, self.executor, self.policy = engine, executor, policy
        self.queue: list[tuple[float, int, int, CodecChunk, asyncio.Future]] = []  # heap: (due, order, cost, ..)
        self._order = itertools.count()
        self.calls: list[tuple[float, float, int, int]] = []
        # its own CUDA stream: sharing the talker's would serialize its steps behind decodes, which separate
        # processes (the deployments) never do
        self.stream = (torch.cuda.Stream(engine.device, priority=-1 if policy.priority == "high" else 0)
                       if engine.device.type == "cuda" and policy.priority != "shared" else None)
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def submit(self, chunk: CodecChunk, deadline: float) -> asyncio.Future:
        """`deadline`: when the stream's player reaches this chunk (the "deadline" order takes the earliest)."""
        future = asyncio.get_running_loop().create_future()
        due = deadline if self.policy.order == "deadline" else time.perf_counter()
        heapq.heappush(self.queue, (due, next(self._order), chunk.codes.shape[0], chunk, future))
        self._wake.set()
        return future

    def _take(self) -> list[tuple[CodecChunk, asyncio.Future]]:
        """The first chunks by due time, up to the policy's chunks and frames (context + new) per call."""
        items, frames, limit = [], 0, self.policy.max_frames or None
        while self.queue and len(items) < self.policy.max_chunks:
            cost = self.queue[0][2]
            if items and limit is not None and frames + cost > limit:
                break
            *_, chunk, future = heapq.heappop(self.queue)
            items.append((chunk, future))
            frames += cost
        return items

    def _decode(self, chunks: list[CodecChunk]) -> list[np.ndarray]:
        if self.stream is None:
            return self.engine.decode(chunks)
        with torch.cuda.stream(self.stream):
            return self.engine.decode(chunks)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
            items = self._take()
            t0 = time.perf_counter()
            waves = await loop.run_in_executor(self.executor, self._decode, [c for c, _ in items])
            self.calls.append((t0, time.perf_counter(), len(items), sum(c.num_new for c, _ in items)))
            for (_, future), wave in zip(items, waves, strict=True):
                if not future.done():
                    future.set_result(wave)


@dataclasses.dataclass
class Record:
    ttfa_s: float
    e2e_s: float
    frames: int
    max_deficit_s: float  # worst playback deficit of a real-time player started at the first audio
    worst_chunk: int = 0  # the chunk (seq) at which that deficit occurred
    worst_decode_wait_s: float = 0.0  # how long that chunk waited from its cut to its decoded audio
    worst_frame_s: float = 0.0  # the talker's time per frame of this stream from its first cut to that chunk's
    bad_codes: str | None = None


async def one_request(engine: TalkerEngine, decoder: Decoder | None, schedule: ChunkSchedule, prompt,
                      request_id: str, frames: int) -> Record:
    request = SynthesisRequest(request_id, prompt, SamplingParams(suppress_eos=True), max_frames=frames)
    t0 = time.perf_counter()
    cut_at: list[float] = []  # per chunk with audio, in stream order: when the talker cut it
    decoded_at: list[float] = []  # ... and when its audio was ready
    audio_s: list[float] = []
    pending: list[asyncio.Future] = []
    first_audio: list[float] = []  # set by the first decoded chunk: the stream's player starts there
    got, bad = 0, None

    def ready(k: int) -> None:
        decoded_at[k] = time.perf_counter()
        if not first_audio:
            first_audio.append(decoded_at[k])

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
        k = len(cut_at)
        cut_at.append(time.perf_counter())
        decoded_at.append(float("nan"))
        # the player starts at the first audio; until then the first chunk's cut stands in for it
        deadline = (first_audio[0] if first_audio else cut_at[0]) + sum(audio_s)
        audio_s.append(chunk.num_new * FRAME_S)
        if decoder is None:
            ready(k)
        else:
            future = decoder.submit(chunk, deadline)
            future.add_done_callback(lambda _f, k=k: ready(k))
            pending.append(future)
    if pending:
        await asyncio.gather(*pending)
    end = time.perf_counter()
    if not cut_at:
        return Record(ttfa_s=end - t0, e2e_s=end - t0, frames=got, max_deficit_s=0.0, bad_codes=bad)
    heard, worst, deficit = playback_deficits(decoded_at, audio_s)
    frames_between = round((sum(audio_s[:worst + 1]) - audio_s[0]) / FRAME_S)
    return Record(ttfa_s=heard[0] - t0, e2e_s=end - t0, frames=got, max_deficit_s=deficit,
                  worst_chunk=worst, worst_decode_wait_s=float(heard[worst] - cut_at[worst]),
                  worst_frame_s=(cut_at[worst] - cut_at[0]) / frames_between if frames_between else 0.0, bad_codes=bad)


def playback_deficits(decoded_at: list[float], audio_s: list[float]) -> tuple[np.ndarray, int, float]:
    """A stream's chunks in stream order (when each was decoded, its seconds of audio) -> when each could be
    heard (a chunk plays only after the ones before it), the chunk with the worst deficit of a real-time
    player started at the first audio (bench.loadgen's continuity; 0 when none), and that deficit (>= 0)."""
    heard = np.maximum.accumulate(np.asarray(decoded_at, dtype=float))
    c = continuity(heard.tolist(), audio_s)
    return heard, c.worst_index or 0, c.max_deficit_s


async def closed_level(engine, decoder, schedule, prompts, c: int, n: int, frames: int, tag: str,
                       stagger_s: float = 0.0) -> dict:
    issued = iter(range(n))
    records: list[Record] = []

    async def client(k: int) -> None:
        if stagger_s:
            await asyncio.sleep(stream_start_s(k, c, stagger_s))  # this client's arrival, a timer as in bench.loadgen
        for i in issued:
            records.append(await one_request(engine, decoder, schedule, prompts[i % len(prompts)],
                                             f"{tag}-{i}", frames))

    before = engine.stats()
    calls_before = len(decoder.calls) if decoder else 0
    t0 = time.perf_counter()
    timeline: dict[str, list] = {"t_ms": [], "steps": [], "frames": [], "running": [], "waiting": []}
    sampler = asyncio.get_running_loop().create_task(_sample(engine, t0, timeline))
    await asyncio.gather(*(client(k) for k in range(c)))
    wall = time.perf_counter() - t0
    sampler.cancel()
    after = engine.stats()
    steps = after.steps - before.steps
    ttfa = [r.ttfa_s * 1e3 for r in records]
    e2e = [r.e2e_s * 1e3 for r in records]
    prefill_s = after.prefill_seconds - before.prefill_seconds
    step_s = after.step_seconds - before.step_seconds
    prefills = after.prefills - before.prefills
    burst_prefills = after.burst_prefills - before.burst_prefills
    per_admitted = max(after.admitted - before.admitted, 1)
    calls = decoder.calls[calls_before:] if decoder else []
    dec_batches = [n for _, _, n, _ in calls]
    gapped = [r for r in records if r.max_deficit_s > GAP_FREE_S]
    return {
        "concurrency": c, "requests": len(records), "frames_per_request": frames,
        "ttfa_ms": {"p50": pct(ttfa, 50), "p95": pct(ttfa, 95), "max": max(ttfa)},
        "e2e_ms": {"p50": pct(e2e, 50), "p95": pct(e2e, 95)},
        "audio_s_per_s": sum(r.frames for r in records) * FRAME_S / wall,
        "gap_free_share": sum(r.max_deficit_s <= GAP_FREE_S for r in records) / max(len(records), 1),
        "max_deficit_ms": {"p50": pct([r.max_deficit_s * 1e3 for r in records], 50),
                           "p95": pct([r.max_deficit_s * 1e3 for r in records], 95)},
        # where the gapped streams gapped: their worst chunk (seq) and how long it waited from cut to audio
        "gapped_worst_chunk": dict(sorted(collections.Counter(r.worst_chunk for r in gapped).items())),
        "gapped_worst_decode_wait_ms": pct([r.worst_decode_wait_s * 1e3 for r in gapped], 50),
        "gapped_talker_ms_per_frame": pct([r.worst_frame_s * 1e3 for r in gapped], 50),
        "steps": steps, "mean_batch": (after.frames - before.frames) / max(steps, 1),
        "step_ms": step_s / max(steps, 1) * 1e3,  # the engine thread's time in its steps
        # of it, blocked until the step's output was ready (the rest: host work and waiting for the GIL)
        "device_wait_ms": (after.device_wait_seconds - before.device_wait_seconds) / max(steps, 1) * 1e3,
        "host_bound_share": (after.host_bound_steps - before.host_bound_steps) / max(steps, 1),
        **step_clock.window_ms(before.device_clock, after.device_clock),  # the device's clock (TalkerRunner)
        "admission_wait_ms": (after.admission_wait_seconds - before.admission_wait_seconds) / per_admitted * 1e3,
        "command_wait_ms": (after.command_wait_seconds - before.command_wait_seconds) / per_admitted * 1e3,
        "prefills": prefills, "burst_prefills": burst_prefills, "prefill_ms": prefill_s / max(prefills, 1) * 1e3,
        "prefill_share": prefill_s / wall, "step_share": step_s / wall,
        "decode_batches": len(dec_batches), "mean_decode_batch": statistics.fmean(dec_batches) if dec_batches else 0,
        "bad_codes": [r.bad_codes for r in records if r.bad_codes],
        "wall_s": wall,
        # the engine's counters every TIMELINE_S, and the decoder's calls (start, end ms; chunks, new frames)
        "timeline": timeline,
        "decode_calls": [(round((a - t0) * 1e3, 1), round((b - t0) * 1e3, 1), n, f) for a, b, n, f in calls],
    }


TIMELINE_S = 0.02


async def _sample(engine: TalkerEngine, t0: float, timeline: dict[str, list]) -> None:
    """The engine's step / frame counters over the level (a bench trace: when steps slowed, how many ran)."""
    while True:
        st = engine.stats()
        for key, value in (("t_ms", round((time.perf_counter() - t0) * 1e3, 1)), ("steps", st.steps),
                           ("frames", st.frames), ("running", st.running), ("waiting", st.waiting)):
            timeline[key].append(value)
        await asyncio.sleep(TIMELINE_S)


async def run(args, model: Qwen3TTS, device: str) -> list[dict]:
    speaker = sorted(model.config.talker.speakers)[0]
    prompts = [build_prompt(model.config, model.tokenizer, s.text, speaker=speaker) for s in load_sentences()]
    schedules = {ramp: ChunkSchedule(first_chunk_frames=args.first_chunk_frames, left_context_frames=args.left_context,
                                     ramp=_parse_ramp(ramp))
                 for ramp in args.ramps.split(",")}
    engine = TalkerEngine(model, TalkerEngineConfig(
        max_num_seqs=args.slots, max_seq_len=args.max_seq_len, kv_cache_tokens=args.kv_tokens,
        cuda_graphs=not args.no_graphs, compile=args.compile, schedule=next(iter(schedules.values())),
        max_prefills_per_step=args.max_prefills_per_step, admission_lead_s=args.admission_lead_s,
        max_prefill_batch=args.max_prefill_batch, prefill_widths=tuple(int(w) for w in args.prefill_widths.split(",")),
        prefill_batches=tuple(int(b) for b in args.prefill_batches.split(",")),
        **kernel_kwargs(args)))
    t0 = time.perf_counter()
    await asyncio.to_thread(engine.start, print)
    print(f"talker engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    executor = ThreadPoolExecutor(1, thread_name_prefix="code2wav")
    c2w = None
    if not args.no_code2wav:
        loop = asyncio.get_running_loop()
        lengths = sorted({n for sch in schedules.values() for n in sch.graph_lengths(args.stateful_code2wav)})
        config = Code2WavEngineConfig(length_buckets=tuple(lengths), max_batch_size=args.decode_batch,
                                      cuda_graphs=not args.no_graphs, stateful=args.stateful_code2wav,
                                      compile=args.compile,
                                      state_slots=max(args.slots, 1))
        c2w = await loop.run_in_executor(executor, Code2WavEngine, model.decoder, config)
        await loop.run_in_executor(executor, c2w.warmup, print)
    policies = [DecodePolicy.parse(p) for p in args.decode_policies.split(",")] if c2w else [None]
    results = []
    for ramp, schedule in schedules.items():  # same engines (compiled and captured once), each variant in turn
        for policy in policies:
            decoder = Decoder(c2w, executor, policy) if c2w else None
            # warm-up: every prompt once (prefill shapes), at a moderate concurrency
            warm = await closed_level(engine, decoder, schedule, prompts, min(16, args.slots), len(prompts), 4, "warm")
            print(f"ramp {ramp}, decode policy {policy}; warm-up: {warm['requests']} requests in {warm['wall_s']:.1f} s",
                  flush=True)
            for c in [int(x) for x in args.levels.split(",")]:
                n = max(args.min_requests, args.per_level * c)
                r = await closed_level(engine, decoder, schedule, prompts, c, n, args.frames, f"c{c}", args.stagger_s)
                r["stagger_s"] = args.stagger_s
                r["decode_policy"] = str(policy) if policy else None
                r["ramp"] = ramp
                results.append(r)
                print(row(r), flush=True)
            if decoder is not None:
                decoder.task.cancel()
    engine.shutdown()
    executor.shutdown(wait=True)
    return results


def _parse_ramp(text: str) -> tuple[int, ...] | None:
    """"geometric": the schedule's default ramp (x2); "1-2-3-5": those chunk sizes after the first."""
    return None if text == "geometric" else tuple(int(n) for n in text.split("-"))


HEADER = ("| ramp | decode policy | c | requests | TTFA p50 / p95 / max (ms) | E2E p50 / p95 (ms) | audio-s/s | gap-free | "
          "gapped at chunk (count); its decode wait, talker ms/frame | mean batch | "
          "step ms (GPU; idle, prefill gap per step, device ms per prefill gap) | "
          "prefills (of them in a burst), ms each | "
          "prefill / step share of wall | "
          "decode batches, mean size | bad codes |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")


def row(r: dict) -> str:
    t, e = r["ttfa_ms"], r["e2e_ms"]
    gapped = ", ".join(f"{k} ({n})" for k, n in r["gapped_worst_chunk"].items())
    if gapped:
        gapped += f"; {r['gapped_worst_decode_wait_ms']:.0f}; {r['gapped_talker_ms_per_frame']:.0f}"
    return (f"| {r.get('ramp', '-')} | {r.get('decode_policy') or '-'} | {r['concurrency']} | {r['requests']} | "
            f"{t['p50']:.1f} / {t['p95']:.1f} / {t['max']:.1f} | "
            f"{e['p50']:.0f} / {e['p95']:.0f} | {r['audio_s_per_s']:.1f} | {r['gap_free_share']:.0%} | "
            f"{gapped or '-'} | {r['mean_batch']:.1f} | "
            f"{r['step_ms']:.2f} ({r.get('gpu_step_ms', 0):.2f}; {r.get('gpu_idle_gap_ms', 0):.2f}, "
            f"{r.get('gpu_prefill_gap_ms', 0):.2f}, {r.get('gpu_ms_per_prefill_gap', 0):.1f}) | "
            f"{r['prefills']} ({r.get('burst_prefills', 0)}), {r['prefill_ms']:.2f} | "
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
    ap.add_argument("--stagger-s", type=float, default=0.0,
                    help="spread each level's client starts over this many seconds (0: all at once)")
    ap.add_argument("--frames", type=int, default=75, help="frames per request (75 = 6 s)")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--kv-tokens", type=int, default=262144, help="KV pool (positions, all requests)")
    ap.add_argument("--first-chunk-frames", type=int, default=2)
    ap.add_argument("--left-context", type=int, default=25)
    ap.add_argument("--ramps", default="geometric",
                    help="chunk ramps after the first chunk, comma list: geometric (x2) or sizes like 2-3-5-8-13-21")
    ap.add_argument("--decode-batch", type=int, default=64, help="chunks in one Code2Wav forward (max_batch_size)")
    ap.add_argument("--decode-policies", default="deadline:256:2048",
                    help="how the decoder takes queued chunks, ORDER:MAX_CHUNKS:MAX_FRAMES per engine call "
                         "(ORDER fifo or deadline; MAX_FRAMES 0 = no limit); a comma list runs each in turn")
    ap.add_argument("--max-prefills-per-step", type=int, default=TalkerEngineConfig.max_prefills_per_step,
                    help="admissions (batched prefills) one engine iteration may launch before its step")
    ap.add_argument("--max-prefill-batch", type=int, default=TalkerEngineConfig.max_prefill_batch,
                    help="requests in one batched prefill (graphed at the --prefill-batches up to it)")
    ap.add_argument("--prefill-batches", default=",".join(map(str, TalkerEngineConfig.prefill_batches)),
                    help="graphed prefill batch sizes, comma list (TalkerEngineConfig.prefill_batches)")
    ap.add_argument("--prefill-widths", default=",".join(map(str, TalkerEngineConfig.prefill_widths)),
                    help="graphed prefill widths, comma list (TalkerEngineConfig.prefill_widths)")
    ap.add_argument("--admission-lead-s", type=float, default=TalkerEngineConfig.admission_lead_s,
                    help="extra admissions only while every playing stream's handed-out audio leads by this much")
    ap.add_argument("--compile", action="store_true", help="torch.compile the talker's layer math and sampling, and "
                    "the codec decoder's dequantizer and pre-transformer (as the served GPU configs)")
    add_kernel_flags(ap)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--no-code2wav", action="store_true", help="talker only (first audio = first chunk cut)")
    ap.add_argument("--stateful-code2wav", action="store_true",
                    help="Code2Wav carries each stream's decoder state (decodes new frames only)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args()

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
