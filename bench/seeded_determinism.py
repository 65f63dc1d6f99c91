"""Seeded determinism across loads, and what deterministic mode costs.

    python -m bench.seeded_determinism --size 1.7b --out bench/out/seeded_determinism.json

Loads a checkpoint (a full-size random one under --workdir unless --checkpoint), runs the Talker engine in
deterministic mode (bf16, CUDA graphs, compiled kernels, max_num_seqs rows) and compares a seeded probe's codes alone
with its codes beside 7, 63, 255 and 511 other requests (half of them arriving while it runs), sampled, and beside
63 greedy; then Code2Wav in deterministic mode: the probe's PCM decoded alone and with other streams' chunks, and at
rows 0, 1, 15, 32 and 63 of full 64-row forwards ("row_r": a row's PCM must not depend on its place). Then
throughput at --concurrency streams, deterministic against the default mode: the Talker engine's frames/s in a closed
loop (each stream starts its next request when the last ends, counted over --sustained-s; `talker_sustained` says
where the engine's device time went) and in a synchronized burst (`talker_burst_cost`); Code2Wav's frames/s decoding
the chunks of that many streams. `--skip-checks`: the throughput only. Prints one JSON:
{"alone_vs_batch": {"8": "identical" | "differs from frame i (k/n frames identical)", ..., "greedy_64": ...},
 "pcm_alone_vs_batch": {"8": ..., "row_15": ...}, "throughput_cost": {"talker": 0.12, "code2wav": 0.05}, ...}.
`--tiny` runs tiny shapes (a CPU smoke run: on CPU the engines are eager).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import time
from pathlib import Path

import numpy as np
import torch

from stages import row_invariant_products
from stages.chunking import ChunkSchedule, StreamChunker
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.contract import SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import write_random_checkpoint
from stages.talker.engine import TalkerEngine
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.stats import EngineStats

SAMPLED = SamplingParams(suppress_eos=True)
GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True)
TEXTS = ("A seeded sentence, the same every time.", "Someone else speaks beside it, longer and slower than that.",
         "Short.", "A third voice, of middling length, with a comma.")


def talker_engine(model: Qwen3TTS, rows: int, frames: int, deterministic: bool) -> TalkerEngine:
    max_seq_len = 256 + frames
    engine = TalkerEngine(model, TalkerEngineConfig(max_num_seqs=rows, max_seq_len=max_seq_len,
                                                    kv_cache_tokens=rows * max_seq_len, deterministic=deterministic))
    engine.start(lambda _m: None)
    return engine


def prompts(model: Qwen3TTS) -> list:
    speakers = sorted(model.config.talker.speakers)
    return [build_prompt(model.config, model.tokenizer, t, speaker=speakers[i % len(speakers)])
            for i, t in enumerate(TEXTS)]


async def _drain(engine, request) -> np.ndarray:
    return np.concatenate([c.codes[c.context:] async for c in engine.add_request(request)])


def probe(engine: TalkerEngine, prompt_list: list, sampling: SamplingParams, others: int, frames: int) -> np.ndarray:
    """The seeded probe's codes beside `others` requests of other seeds, prompts and lengths: half start with it,
    the rest arrive once its first chunk is out (their prefills run between its steps)."""
    async def run():
        def other(i):
            return _drain(engine, SynthesisRequest(f"o{others}-{i}", prompt_list[1 + i % 3], sampling,
                                                   frames + i % 11, seed=i))
        first = [asyncio.create_task(other(i)) for i in range(others // 2)]
        stream = engine.add_request(SynthesisRequest(f"probe-{others}", prompt_list[0], sampling, frames, seed=1234),
                                    ChunkSchedule(first_chunk_frames=1))
        blocks, later = [], []
        async for chunk in stream:
            blocks.append(chunk.codes[chunk.context:])
            if len(blocks) == 1:
                later = [asyncio.create_task(other(i)) for i in range(others // 2, others)]
        await asyncio.gather(*first, *later)
        return np.concatenate(blocks)
    return asyncio.run(run())


def compare(alone: np.ndarray, other: np.ndarray) -> str:
    if alone.shape == other.shape and np.array_equal(alone, other):
        return "identical"
    same = (alone == other).reshape(len(alone), -1).all(axis=1) if alone.shape == other.shape else np.zeros(1, bool)
    return f"differs from frame {int(np.argmin(same))} ({int(same.sum())}/{len(alone)} frames identical)"


def alone_vs_batch(engine: TalkerEngine, prompt_list: list, batches: list[int], frames: int) -> dict[str, str]:
    """{"8": ..., "64": ..., "greedy_64": ...}: the probe beside batch - 1 others, against the probe alone."""
    out = {}
    for sampling, name in ((SAMPLED, ""), (GREEDY, "greedy_")):
        alone = probe(engine, prompt_list, sampling, 0, frames)
        for b in batches if sampling is SAMPLED else [64]:
            out[f"{name}{b}"] = compare(alone, probe(engine, prompt_list, sampling, b - 1, frames))
    return out


def talker_frames_per_s(engine: TalkerEngine, prompt_list: list, concurrency: int, frames: int) -> float:
    """Burst: frames per second of `concurrency` streams of `frames` frames each, all started together (after one
    warm run): every prompt's prefill at once, then the decode."""
    async def run():
        await asyncio.gather(*(_drain(engine, SynthesisRequest(f"t{i}-{time.monotonic_ns()}", prompt_list[i % 4],
                                                                SAMPLED, frames, seed=i)) for i in range(concurrency)))
    asyncio.run(run())
    t0 = time.perf_counter()
    asyncio.run(run())
    return concurrency * frames / (time.perf_counter() - t0)


def talker_sustained(engine: TalkerEngine, prompt_list: list, concurrency: int, frames: int,
                     seconds: float, warmup_s: float) -> dict:
    """Closed loop, as the served figures are measured: `concurrency` streams, each starting its next request when
    the last ends (their first requests of 1..`frames` frames, so that ends and prefills spread over the steps).
    -> frames/s counted over `seconds` after `warmup_s`, and where the engine's time went in that window."""
    async def run():
        loop = asyncio.get_running_loop()
        start = loop.time() + warmup_s
        stop = start + seconds
        counted, before = 0, None

        async def stream(i: int) -> None:
            nonlocal counted, before
            n = 0
            while loop.time() < stop:
                length = 1 + i * frames // concurrency if n == 0 else frames
                request = SynthesisRequest(f"s{i}-{n}-{time.monotonic_ns()}", prompt_list[(i + n) % 4], SAMPLED,
                                           length, seed=1000 * i + n)
                async for chunk in engine.add_request(request):
                    now = loop.time()
                    if before is None and now >= start:
                        before = engine.stats()
                    if start <= now < stop:
                        counted += chunk.codes.shape[0] - chunk.context
                n += 1

        async def snapshot_at_stop() -> EngineStats:
            await asyncio.sleep(stop - loop.time())
            return engine.stats()

        at_stop = asyncio.create_task(snapshot_at_stop())
        await asyncio.gather(*(stream(i) for i in range(concurrency)))
        return counted / seconds, before, await at_stop
    fps, a, b = asyncio.run(run())
    steps = b.steps - a.steps
    clock_a, clock_b = a.device_clock, b.device_clock
    return {"frames_per_s": round(fps, 1), "steps": steps, "mean_step_rows": round((b.frames - a.frames) / max(steps, 1), 1),
            "prefills": b.prefills - a.prefills, "admitted": b.admitted - a.admitted,
            "device_step_ms": round(1000 * (clock_b.step_seconds - clock_a.step_seconds) / max(
                clock_b.steps - clock_a.steps, 1), 3),
            "device_prefill_s_per_s": round((clock_b.prefill_device_seconds - clock_a.prefill_device_seconds) / seconds, 3),
            "device_step_s_per_s": round((clock_b.step_seconds - clock_a.step_seconds) / seconds, 3),
            "device_idle_s_per_s": round((clock_b.idle_gap_seconds - clock_a.idle_gap_seconds) / seconds, 3)}


def stream_chunks(schedule: ChunkSchedule, request_id: str, codes: np.ndarray) -> list:
    """A stream's chunks as the Talker cuts them."""
    chunker = StreamChunker(schedule, request_id)
    out = chunker.push(codes)
    last = chunker.flush()
    return out + ([last] if last is not None else [])


def pcm_by_row(engine: Code2WavEngine, probe_codes: np.ndarray, rows: tuple[int, ...], batch: int,
               schedule: ChunkSchedule | None = None) -> dict[str, str]:
    """{"row_r": the probe's PCM at row r of full `batch`-row forwards vs alone}: each chunk of the probe decoded
    beside `batch` - 1 other streams' chunks of its length (streams as long as the probe), at row r."""
    if not rows:
        return {}
    schedule = schedule or ChunkSchedule()
    rng = np.random.default_rng(1)
    crowd_codes = [rng.integers(0, 2048, probe_codes.shape) for _ in range(batch - 1)]

    def decode(tag: str, row: int | None) -> np.ndarray:
        crowd = [] if row is None else [stream_chunks(schedule, f"{tag}-{i}", c) for i, c in enumerate(crowd_codes)]
        pcm = []
        for k, chunk in enumerate(stream_chunks(schedule, f"{tag}-probe", probe_codes)):
            others, at = [s[k] for s in crowd], row or 0
            pcm.append(engine.decode([*others[:at], chunk, *others[at:]])[at])
        return np.concatenate(pcm)

    alone = decode("rows-alone", None)
    return {f"row_{r}": compare(alone, decode(f"rows-{r}", r)) for r in rows}


def code2wav_checks(decoder, probe_codes: np.ndarray, batches: list[int], concurrency: int, rows: int,
                    by_row: tuple[int, ...] = ()):
    """(PCM alone vs beside others, {mode: frames/s}) of Code2Wav's stateful engine, deterministic and default;
    `by_row`: also the probe's PCM at these rows of full 64-row forwards vs alone (`pcm_by_row`)."""
    schedule = ChunkSchedule()

    def streams(n, tag):
        rng = np.random.default_rng(n)
        return [stream_chunks(schedule, f"{tag}{i}", rng.integers(0, 2048, (len(probe_codes) + i % 7, 16)))
                for i in range(n)]

    def decode_probe(engine, others):
        target, crowd, pcm = stream_chunks(schedule, f"probe-{others}", probe_codes), streams(others, f"c{others}-"), []
        for k, chunk in enumerate(target):
            batch = [s[k] for s in crowd if k < len(s)]
            pcm.append(engine.decode([*batch[::2], chunk, *batch[1::2]])[len(batch[::2])])
        return np.concatenate(pcm)

    def frames_per_s(engine):
        work = streams(concurrency, "t")
        t0 = time.perf_counter()
        for k in range(max(len(s) for s in work)):
            engine.decode([s[k] for s in work if k < len(s)])
        return sum(c.num_new for s in work for c in s) / (time.perf_counter() - t0)

    pcm, speed = {}, {}
    for deterministic in (True, False):
        engine = Code2WavEngine(decoder, Code2WavEngineConfig.for_schedule(
            schedule, max_batch_size=64, state_slots=max(512, 2 * rows), deterministic=deterministic))
        engine.warmup(lambda _m: None)
        if deterministic:
            alone = decode_probe(engine, 0)
            pcm = {str(b): compare(alone, decode_probe(engine, b - 1)) for b in batches}
            pcm.update(pcm_by_row(engine, probe_codes, by_row, 64, schedule))
        frames_per_s(engine)  # warm
        speed["deterministic" if deterministic else "default"] = frames_per_s(engine)
        del engine
    return pcm, speed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: a random one of --size under --workdir)")
    ap.add_argument("--size", default="1.7b", choices=["0.6b", "1.7b"])
    ap.add_argument("--workdir", default="/tmp/qwen3-tts-bench")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--batches", default="8,64,256,512")
    ap.add_argument("--frames", type=int, default=40, help="frames of the probe")
    ap.add_argument("--concurrency", type=int, default=256, help="streams of the throughput comparison")
    ap.add_argument("--throughput-frames", type=int, default=75, help="frames of each throughput request (6 s)")
    ap.add_argument("--sustained-s", type=float, default=20.0, help="closed-loop window of the throughput comparison")
    ap.add_argument("--skip-checks", action="store_true", help="throughput only (no invariance checks)")
    ap.add_argument("--throughput-rows", type=int, default=None, help=(
        "max_num_seqs of the throughput comparison's engines (default: the largest batch): deterministic mode runs "
        "every step at this many rows, so a deployment sized to its concurrency pays least"))
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cuda":
        # before the first product (older torch reads the setting once): both modes then run without a workspace,
        # as fast as with one for these products
        row_invariant_products.use_no_workspace()
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = Path(args.workdir) / f"{args.size}-custom_voice{'-tiny' if args.tiny else ''}"
        if not (ckpt / "config.json").exists():
            write_random_checkpoint(ckpt, args.size, "custom_voice", tiny=args.tiny, dtype=dtype, device=device)
    batches = [int(b) for b in args.batches.split(",")]
    rows = max(batches)
    frames = max(args.frames, args.throughput_frames)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "checkpoint": str(ckpt),
                    "dtype": dtype, "max_num_seqs": rows, "concurrency": args.concurrency,
                    "date": datetime.date.today().isoformat()}
    speed = {}
    probe_codes = None
    throughput_rows = args.throughput_rows or rows
    result["throughput_rows"] = throughput_rows
    runs = ([] if args.skip_checks else [(True, rows, True)]) + (
        [(True, throughput_rows, False)] if throughput_rows != rows or args.skip_checks else [])
    sustained, burst = {}, {}
    for deterministic, n, checks in [*runs, (False, throughput_rows, False)]:
        # one engine at a time: each loads its own model (compile rewrites it)
        model = Qwen3TTS.load(ckpt, device=device, dtype=dtype, decoder=False, voice=False, log=lambda _m: None)
        engine = talker_engine(model, n, frames, deterministic)
        try:
            plist = prompts(model)
            if checks:
                result["alone_vs_batch"] = alone_vs_batch(engine, plist, batches, args.frames)
                probe_codes = probe(engine, plist, SAMPLED, 0, args.frames)
            if n == throughput_rows:
                mode = "deterministic" if deterministic else "default"
                sustained[mode] = talker_sustained(engine, plist, args.concurrency, args.throughput_frames,
                                                   args.sustained_s, warmup_s=min(5.0, args.sustained_s / 2))
                speed[mode] = sustained[mode]["frames_per_s"]
                burst[mode] = talker_frames_per_s(engine, plist, args.concurrency, args.throughput_frames)
                print(json.dumps({mode: sustained[mode], "burst_frames_per_s": burst[mode]}), flush=True)
        finally:
            engine.shutdown()
        del engine, model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    result["talker_sustained"] = sustained
    result["talker_burst_cost"] = round(1 - burst["deterministic"] / burst["default"], 4)
    if probe_codes is None:
        probe_codes = np.random.default_rng(0).integers(0, 2048, (args.frames, 16))
    decoder = Qwen3TTS.load(ckpt, device=device, dtype=dtype, talker=False, decoder=True, voice=False).decoder
    pcm, c2w_speed = code2wav_checks(decoder, probe_codes, [] if args.skip_checks else batches, args.concurrency,
                                     rows, () if args.skip_checks else (0, 1, 15, 32, 63))
    if not args.skip_checks:
        result["pcm_alone_vs_batch"] = pcm
    result["frames_per_s"] = {"talker": speed, "code2wav": c2w_speed}
    result["throughput_cost"] = {k: round(1 - s["deterministic"] / s["default"], 4)
                                 for k, s in (("talker", speed), ("code2wav", c2w_speed))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
