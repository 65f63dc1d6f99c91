"""Code2Wav engine throughput and first-chunk latency (self-contained: builds a random full-size decoder).

Measures, with the default chunk schedule (first 2 -> doubling -> steady 25, left context 50):
- audio-seconds decoded per second at each batch size, for (a) steady chunks (context + 25 new frames) and
  (b) the schedule's mix of chunks (first, ramp, steady and final chunks of `--utterance-frames` streams);
- the same steady chunks without left context;
- streams: `batch` streams at staggered points of their schedule, each call decoding the next chunk of every
  stream (new request ids as streams restart), which is what a stateful engine (`--stateful`) continues;
- latency of one first chunk at batch 1 (plain and Base ICL with reference context), end to end;
- FLOPs per decoded frame, the context overhead (decoded / new frames) and achieved TFLOP/s, and
  whether one device keeps up with `--target` audio-s/s.
Writes JSON and a markdown table to `--out` and prints the table last.

    python -m bench.code2wav                 # from the repo root; H100, bf16, CUDA graphs (~3-5 min)
    python -m bench.code2wav --stateful      # the stateful engine (steady/mixed chunks are then all misses)
    python -m bench.code2wav --tiny          # CPU smoke test, tiny decoder
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from stages.chunking import ChunkSchedule, StreamChunker
from stages.code2wav.config import DecoderConfig
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.code2wav.model import Code2WavDecoder, randomize_codebooks_
from stages.contract import CodecChunk

FRAME_S = 0.08


def build_decoder(tiny: bool, device: str, dtype: torch.dtype, seed: int = 0) -> Code2WavDecoder:
    """The released decoder shapes (or the tiny test shapes), `randomize_codebooks_` weights."""
    from stages.random_checkpoint import codec_config

    cfg = DecoderConfig.from_dict(codec_config(tiny)["decoder_config"])
    torch.manual_seed(seed)
    with torch.device(device):
        decoder = Code2WavDecoder(cfg)
    randomize_codebooks_(decoder, torch.Generator(device=device).manual_seed(seed))
    return decoder.to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_decode(engine: Code2WavEngine, batches: list[list[CodecChunk]], min_s: float, min_iters: int) -> float:
    """Seconds per decode() call (mean over >= min_iters calls and >= min_s seconds), cycling through batches."""
    engine.decode(batches[0])  # warm (eager shapes: cuDNN plans, allocator)
    sync(engine.device)
    n, t0 = 0, time.perf_counter()
    while n < min_iters or time.perf_counter() - t0 < min_s:
        engine.decode(batches[n % len(batches)])
        n += 1
    sync(engine.device)
    return (time.perf_counter() - t0) / n


def random_chunk(rng: np.random.Generator, ctx: int, new: int, rid: str = "r", seq: int = 0) -> CodecChunk:
    return CodecChunk(rid, seq, rng.integers(0, 2048, (ctx + new, 16), dtype=np.int64), ctx)


def mixed_batches(rng: np.random.Generator, schedule: ChunkSchedule, utterance: int, batch: int,
                  count: int) -> list[list[CodecChunk]]:
    """Batches of chunks from `batch` streams at random points of their schedule (the steady-state mix)."""
    stream = rng.integers(0, 2048, (utterance, 16), dtype=np.int64)
    chunker = StreamChunker(schedule, "mix")
    plan = [*chunker.push(stream), chunker.flush()]
    # one request id per chunk: a stateful engine decodes each fresh, over its context (its fallback path)
    return [[dataclasses.replace(plan[int(k)], request_id=f"mix{j}") for j, k in
             enumerate(rng.integers(0, len(plan), batch))] for _ in range(count)]


def stream_calls(rng: np.random.Generator, schedule: ChunkSchedule, utterance: int, batch: int,
                 calls: int) -> list[list[CodecChunk]]:
    """`calls` decode calls over `batch` concurrent streams, each call holding the next chunk of every stream.

    Stream i starts at chunk i of the plan (staggered, so every call mixes first, ramp, steady and final
    chunks); a stream that ends starts again under a new request id."""
    stream = rng.integers(0, 2048, (utterance, 16), dtype=np.int64)
    chunker = StreamChunker(schedule, "s")
    plan = [c for c in [*chunker.push(stream), chunker.flush()] if c.num_new > 0]
    out = []
    for k in range(calls):
        call = []
        for i in range(batch):
            n = k + i
            call.append(dataclasses.replace(plan[n % len(plan)], request_id=f"s{i}.{n // len(plan)}"))
        out.append(call)
    return out


def time_calls(engine: Code2WavEngine, calls: list[list[CodecChunk]]) -> tuple[float, int]:
    """Seconds and new frames over the calls, decoded once each in order (stream state carries over)."""
    sync(engine.device)
    t0 = time.perf_counter()
    for call in calls:
        engine.decode(call)
    sync(engine.device)
    return time.perf_counter() - t0, sum(c.num_new for call in calls for c in call)


def profile_streams(decoder: Code2WavDecoder, engine: Code2WavEngine, rng: np.random.Generator,
                    schedule: ChunkSchedule, utterance: int, batch: int, out: str) -> None:
    """Top CUDA kernels of eager streams calls (same kernels as the graphs replay) at `batch`."""
    from torch.profiler import ProfilerActivity, profile

    eager = Code2WavEngine(decoder, dataclasses.replace(engine.config, cuda_graphs=False))
    plan_len = len(schedule.plan(utterance))
    calls = stream_calls(rng, schedule, utterance, batch, 2 * plan_len)
    time_calls(eager, calls[:plan_len])
    cuda = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        time_calls(eager, calls[plan_len:])
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=50,
                                      max_name_column_width=160)  # cuDNN's names carry the tiles
    print(f"profile: {plan_len} eager streams calls at batch {batch} ({'stateful' if engine.stateful else 'stateless'})\n"
          + table, flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"profile_b{batch}.txt").write_text(table)


def flops_per_frame(decoder: Code2WavDecoder, frames: int) -> float:
    dev = next(decoder.parameters()).device
    codes = torch.zeros(1, decoder.cfg.num_quantizers, frames, dtype=torch.long, device=dev)
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        decoder(codes)
    return counter.get_total_flops() / frames


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny decoder and small batches: a CPU smoke test")
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batches", default=None, help="batch sizes (default 1,8,32,64,128,256; --tiny 1,2,4)")
    ap.add_argument("--first", type=int, default=ChunkSchedule.first_chunk_frames)
    ap.add_argument("--steady", type=int, default=ChunkSchedule.steady_chunk_frames)
    ap.add_argument("--left-context", type=int, default=ChunkSchedule.left_context_frames)
    ap.add_argument("--utterance-frames", type=int, default=125, help="stream length for the mixed batches (10 s)")
    ap.add_argument("--seconds", type=float, default=None, help="minimum timing per point (default 2; --tiny 0)")
    ap.add_argument("--no-graphs", action="store_true", help="eager only")
    ap.add_argument("--no-fast-kernels", action="store_true", help="the eager modules (no fused Triton kernels)")
    ap.add_argument("--stateful", action="store_true", help="the stateful engine (carried decoder state)")
    ap.add_argument("--compile", action="store_true", help="CUDA: torch.compile the dequantizer and the "
                    "pre-transformer (stages/code2wav/compiled.py)")
    ap.add_argument("--cudnn-benchmark", action="store_true", help="torch.backends.cudnn.benchmark = True")
    ap.add_argument("--profile", action="store_true",
                    help="after the table: torch profiler over eager streams calls at the largest batch, top kernels")
    ap.add_argument("--max-frames-per-forward", type=int, default=8192,
                    help="engine limit on padded batch x length per forward (activation memory)")
    ap.add_argument("--target", type=float, default=1000.0, help="audio-s/s to keep up with")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    batch_sizes = [int(b) for b in (args.batches or ("1,2,4" if args.tiny else "1,8,32,64,128,256")).split(",")]
    min_s = args.seconds if args.seconds is not None else (0.0 if args.tiny else 2.0)
    min_iters = 1 if args.tiny else 3
    command = " ".join(["python -m bench.code2wav", *map(shlex.quote, sys.argv[1:])])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "cpu")
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# code2wav engine benchmark\ncommand: {command}\ndevice: {device_name} ({device}), torch "
          f"{torch.__version__}, {dtype}\ndate: {date}", flush=True)
    t_start = time.perf_counter()

    torch.backends.cudnn.benchmark = args.cudnn_benchmark
    decoder = build_decoder(args.tiny, str(device), dtype)
    L, steady = args.left_context, args.steady
    schedule = ChunkSchedule(first_chunk_frames=args.first, steady_chunk_frames=steady, left_context_frames=L)
    fpf = flops_per_frame(decoder, L + steady)  # before the engine switches kernels (FLOPs are the same)
    max_b = max(batch_sizes)
    lengths = sorted({*schedule.decode_lengths(ref_frames=(L,)), steady})  # + no-context steady chunks
    if args.stateful:
        lengths = sorted({*schedule.chunk_sizes(), L + steady})
    engine = Code2WavEngine(decoder, Code2WavEngineConfig(
        max_batch_size=max_b, batch_buckets=tuple(batch_sizes), length_buckets=tuple(lengths),
        cuda_graphs=not args.no_graphs, fast_kernels=not args.no_fast_kernels,
        max_frames_per_forward=args.max_frames_per_forward, stateful=args.stateful,
        state_slots=2 * max_b, compile=args.compile,
    ))
    print(f"decoder built, {fpf / 1e9:.2f} GFLOP per decoded frame (FlopCounterMode, T={L + steady}); "
          f"schedule {[schedule.chunk_frames(i) for i in range(6)]}..., left context {L}", flush=True)
    warmup_s = engine.warmup(log=lambda m: print(m, flush=True))
    meta_mem = None
    if device.type == "cuda":
        meta_mem = torch.cuda.memory_reserved(device) / 2**30
        print(f"GPU memory after warm-up: {torch.cuda.memory_reserved(device) / 2**30:.2f} GiB reserved", flush=True)

    rng = np.random.default_rng(0)
    rows = []
    plan = schedule.plan(args.utterance_frames)
    mix_overhead = sum(c + n for c, n in plan) / sum(n for _, n in plan)
    for b in batch_sizes:
        steady_b = [[random_chunk(rng, L, steady, f"s{i}") for i in range(b)] for _ in range(2)]
        t_steady = time_decode(engine, steady_b, min_s, min_iters)
        nocxt_b = [[random_chunk(rng, 0, steady, f"s{i}") for i in range(b)] for _ in range(2)]
        t_nocxt = time_decode(engine, nocxt_b, min_s, min_iters)
        mixed = mixed_batches(rng, schedule, args.utterance_frames, b, 4)
        before = engine.stats()
        t_mixed = time_decode(engine, mixed, min_s, min_iters)
        after = engine.stats()
        plan_len = len([n for _, n in plan if n])
        time_calls(engine, stream_calls(rng, schedule, args.utterance_frames, b, plan_len))  # warm, then timed
        t_streams, new_streams = time_calls(engine, stream_calls(rng, schedule, args.utterance_frames, b,
                                                                 max(2, 4 if args.tiny else 6) * plan_len))
        calls = after.batches - before.batches
        new_mixed = (after.new_frames - before.new_frames) / calls
        padded_mixed = (after.padded_frames - before.padded_frames) / calls
        row = dict(
            batch=b,
            steady_ms=t_steady * 1e3, steady_audio_s_per_s=b * steady * FRAME_S / t_steady,
            steady_tflops=b * (L + steady) * fpf / t_steady / 1e12,
            no_context_audio_s_per_s=b * steady * FRAME_S / t_nocxt,
            mixed_ms=t_mixed * 1e3, mixed_audio_s_per_s=new_mixed * FRAME_S / t_mixed,
            mixed_padded_over_new=padded_mixed / new_mixed, mixed_forwards=(after.forwards - before.forwards) / calls,
            mixed_tflops=padded_mixed * fpf / t_mixed / 1e12,
            streams_audio_s_per_s=new_streams * FRAME_S / t_streams,
        )
        rows.append(row)
        print(f"batch {b:>4}: steady {row['steady_audio_s_per_s']:8.1f} audio-s/s ({row['steady_ms']:.1f} ms, "
              f"{row['steady_tflops']:.1f} TFLOP/s) | no context {row['no_context_audio_s_per_s']:8.1f} | mixed "
              f"{row['mixed_audio_s_per_s']:8.1f} audio-s/s ({row['mixed_ms']:.1f} ms, {row['mixed_forwards']:.1f} "
              f"forwards, padded/new {row['mixed_padded_over_new']:.2f}) | streams "
              f"{row['streams_audio_s_per_s']:8.1f} audio-s/s", flush=True)

    latency = {}
    for name, ctx in (("first chunk", 0), ("first chunk, ICL (reference context)", L), ("steady chunk", L)):
        n_new = args.first if name.startswith("first") else steady
        chunk = [random_chunk(rng, ctx, n_new)]
        engine.decode(chunk)
        times = []
        for _ in range(5 if args.tiny else 50):
            t0 = time.perf_counter()
            engine.decode(chunk)
            times.append((time.perf_counter() - t0) * 1e3)
        latency[name] = dict(frames=ctx + n_new, p50_ms=statistics.median(times), min_ms=min(times),
                             p90_ms=sorted(times)[int(0.9 * (len(times) - 1))])
        print(f"latency, {name} ({ctx} + {n_new} frames, batch 1): p50 {latency[name]['p50_ms']:.2f} ms, "
              f"p90 {latency[name]['p90_ms']:.2f} ms", flush=True)

    best_streams = max(rows, key=lambda r: r["streams_audio_s_per_s"])
    best = max(rows, key=lambda r: r["mixed_audio_s_per_s"])
    need_tflops = args.target / FRAME_S * best["mixed_padded_over_new"] * fpf / 1e12
    verdict = (f"best mixed throughput {best['mixed_audio_s_per_s']:.0f} audio-s/s at batch {best['batch']} "
               f"(target {args.target:.0f}: {'met' if best['mixed_audio_s_per_s'] >= args.target else 'NOT met'}). "
               f"{args.target:.0f} audio-s/s = {args.target / FRAME_S:.0f} new frames/s x "
               f"{best['mixed_padded_over_new']:.2f} (context + padding) x {fpf / 1e9:.2f} GFLOP/frame = "
               f"{need_tflops:.0f} TFLOP/s needed; achieved {best['mixed_tflops']:.0f} TFLOP/s; "
               f"context alone costs x{mix_overhead:.2f} over {args.utterance_frames}-frame streams "
               f"(x{(L + steady) / steady:.2f} in steady state). Streams ({'stateful' if args.stateful else 'stateless'}"
               f"): best {best_streams['streams_audio_s_per_s']:.0f} audio-s/s at batch {best_streams['batch']}")
    print(verdict)
    if args.profile:
        profile_streams(decoder, engine, rng, schedule, args.utterance_frames, max_b, args.out)
    stats = engine.stats()
    meta = dict(command=command, device=device_name, torch=torch.__version__, dtype=str(dtype), date=date,
                tiny=args.tiny, fast_kernels=engine.fast_kernels, compiled=engine.compiled, stateful=args.stateful,
                stateful_counts=dict(continued=stats.continued, fresh=stats.fresh, evicted=stats.evicted),
                schedule=dict(first=args.first, steady=steady, left_context=L),
                utterance_frames=args.utterance_frames, flops_per_frame=fpf, warmup_s=warmup_s,
                graphs=stats.graphs, gpu_reserved_gib=meta_mem, max_frames_per_forward=args.max_frames_per_forward,
                context_overhead_utterance=mix_overhead, total_s=time.perf_counter() - t_start)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    (out_dir / f"code2wav_bench_{stamp}.json").write_text(
        json.dumps(dict(meta=meta, rows=rows, latency=latency, verdict=verdict), indent=1))
    lines = [f"command: `{command}`  ", f"device: {device_name}, torch {torch.__version__}, {dtype}, {date}  ",
             f"schedule: first {args.first} -> doubling -> steady {steady}, left context {L}; "
             f"{fpf / 1e9:.2f} GFLOP/frame; fused kernels {engine.fast_kernels}; {stats.graphs} CUDA graphs captured in "
             f"{warmup_s:.1f} s", "",
             f"engine: {'stateful' if args.stateful else 'stateless'}, compiled {engine.compiled}", "",
             "| batch | steady audio-s/s | steady ms | steady TFLOP/s | no-context audio-s/s | mixed audio-s/s "
             "| mixed ms | mixed padded/new | mixed TFLOP/s | streams audio-s/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['steady_audio_s_per_s']:.1f} | {r['steady_ms']:.1f} | "
                     f"{r['steady_tflops']:.1f} | {r['no_context_audio_s_per_s']:.1f} | "
                     f"{r['mixed_audio_s_per_s']:.1f} | {r['mixed_ms']:.1f} | {r['mixed_padded_over_new']:.2f} | "
                     f"{r['mixed_tflops']:.1f} | {r['streams_audio_s_per_s']:.1f} |")
    lines += ["", "| latency, batch 1 | frames | p50 ms | p90 ms |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['frames']} | {v['p50_ms']:.2f} | {v['p90_ms']:.2f} |" for k, v in latency.items()]
    lines += ["", verdict]
    md = "\n".join(lines) + "\n"
    (out_dir / f"code2wav_bench_{stamp}.md").write_text(md)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s\n\n" + md)


if __name__ == "__main__":
    main()
