"""Fidelity of stateless chunked decoding: chunks with left context vs one whole-utterance decode.

Builds a full-size random codec decoder (the released shapes, `randomize_codebooks_` recipe), decodes
random code streams once whole (exact reference, fp32) and again through `StreamChunker` +
`Code2WavEngine` with the default chunk schedule at several left contexts. Reports max |error|, SNR
(dB) over the utterances and the worst chunk, the cost factor (decoded / new frames), the official
decode's own 300/25 chunking for comparison, and the bf16 noise floor (bf16 vs fp32 whole decodes).

    python -m bench.code2wav_fidelity --device cuda              # from the repo root; the study in docs/code2wav.md
    python -m bench.code2wav_fidelity --tiny --frames 120 --streams 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from stages.chunking import ChunkSchedule, StreamChunker, receptive_field_frames
from stages.code2wav.config import DecoderConfig
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.code2wav.model import Code2WavDecoder, randomize_codebooks_
from stages.contract import CodecChunk

SPF = 1920


def build_decoder(tiny: bool, device: str, seed: int) -> Code2WavDecoder:
    from stages.random_checkpoint import codec_config

    cfg = DecoderConfig.from_dict(codec_config(tiny)["decoder_config"])
    torch.manual_seed(seed)
    with torch.device(device):
        decoder = Code2WavDecoder(cfg)
    randomize_codebooks_(decoder, torch.Generator(device=device).manual_seed(seed))
    return decoder.eval()


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    noise = float(np.sum((out.astype(np.float64) - ref) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)


def compare(ref: list[np.ndarray], out: list[np.ndarray], bounds: list[list[tuple[int, int]]]) -> dict:
    """Errors over all streams; `bounds[s]` are the (start, end) frames of stream s's chunks."""
    r, o = np.concatenate(ref), np.concatenate(out)
    err = np.abs(o - r)
    chunk_snr, first_err = [], 0.0
    for s, spans in enumerate(bounds):
        for k, (a, b) in enumerate(spans):
            if b > a:
                seg_r, seg_o = ref[s][a * SPF:b * SPF], out[s][a * SPF:b * SPF]
                chunk_snr.append(snr_db(seg_r, seg_o))
                if k == 0:
                    first_err = max(first_err, float(np.abs(seg_o - seg_r).max()))
    return dict(max_abs=float(err.max()), mean_abs=float(err.mean()), snr_db=snr_db(r, o),
                worst_chunk_snr_db=min(chunk_snr) if chunk_snr else float("inf"), first_chunk_max_abs=first_err,
                ref_peak=float(np.abs(r).max()), ref_rms=float(np.sqrt(np.mean(r.astype(np.float64) ** 2))))


def decode_streams(engine: Code2WavEngine, chunks: list[CodecChunk], spans: list[list]) -> list[np.ndarray]:
    """One decode() call for every chunk; each stream's waves (len(spans[s]) chunks, in order) joined."""
    waves = engine.decode(chunks)
    out, k = [], 0
    for sp in spans:
        out.append(np.concatenate(waves[k:k + len(sp)]))
        k += len(sp)
    return out


def chunked(engine: Code2WavEngine, streams: np.ndarray, schedule: ChunkSchedule):
    """Every chunk of every stream in one decode() call; returns (wav per stream, chunk spans per stream)."""
    chunks: list[CodecChunk] = []
    spans = []
    for s, codes in enumerate(streams):
        chunker = StreamChunker(schedule, f"s{s}")
        mine = [*chunker.push(codes), chunker.flush()]
        start, sp = 0, []
        for c in mine:
            sp.append((start, start + c.num_new))
            start += c.num_new
        spans.append(sp)
        chunks.extend(mine)
    out = decode_streams(engine, chunks, spans)
    decoded = sum(c.codes.shape[0] for c in chunks)
    new = sum(c.num_new for c in chunks)
    return out, spans, decoded / new


@torch.inference_mode()
def whole(decoder: Code2WavDecoder, streams: np.ndarray) -> list[np.ndarray]:
    dev = next(decoder.parameters()).device
    wav = decoder(torch.from_numpy(streams).transpose(1, 2).contiguous().to(dev))[:, 0]
    return [w.float().cpu().numpy() for w in wav]


def official_chunked(engine: Code2WavEngine, streams: np.ndarray, chunk: int = 300, ctx: int = 25):
    """The official `chunked_decode(chunk_size=300, left_context_size=25)` through the engine."""
    chunks, spans = [], []
    for s, codes in enumerate(streams):
        sp = []
        for start in range(0, len(codes), chunk):
            c0 = max(0, start - ctx)
            chunks.append(CodecChunk(f"s{s}", len(sp), codes[c0:start + chunk], start - c0))
            sp.append((start, min(len(codes), start + chunk)))
        spans.append(sp)
    out = decode_streams(engine, chunks, spans)
    return out, spans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny decoder (CPU smoke test), not the released shapes")
    ap.add_argument("--checkpoint", default=None, help="a real checkpoint dir: its trained decoder instead of random")
    ap.add_argument("--frames", type=int, default=500, help="frames per utterance (80 ms each)")
    ap.add_argument("--streams", type=int, default=4, help="random utterances")
    ap.add_argument("--contexts", default="0,25,50,72,100,150,250", help="left contexts (frames) to measure")
    ap.add_argument("--first", type=int, default=ChunkSchedule.first_chunk_frames)
    ap.add_argument("--steady", type=int, default=ChunkSchedule.steady_chunk_frames)
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 rows")
    ap.add_argument("--max-frames", type=int, default=1024, help="frames per forward (batches of chunks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/out", help="folder for the JSON and markdown results")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    torch.backends.cudnn.allow_tf32 = False
    if hasattr(torch.backends, "fp32_precision"):  # torch >= 2.9 API, set as well
        torch.backends.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
    command = " ".join(["python -m bench.code2wav_fidelity", *map(shlex.quote, sys.argv[1:])])
    on_cuda = args.device.startswith("cuda")
    device_name = torch.cuda.get_device_name(args.device) if on_cuda else platform.processor() or "cpu"
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# code2wav fidelity\ncommand: {command}\ndevice: {device_name} ({args.device}), torch {torch.__version__}\n"
          f"date: {date}", flush=True)

    t0 = time.perf_counter()
    if args.checkpoint:
        from stages.qwen3_tts import Qwen3TTS

        decoder = Qwen3TTS.load(args.checkpoint, args.device, "float32", talker=False, decoder=True,
                                voice=False).decoder.eval()
    else:
        decoder = build_decoder(args.tiny, args.device, args.seed)
    rf = receptive_field_frames(decoder.cfg)
    rng = np.random.default_rng(args.seed)
    streams = rng.integers(0, 2048, (args.streams, args.frames, 16), dtype=np.int64)
    # fp32 rows: the eager modules (the chunking error alone); bf16 rows: the serving kernels
    # not compiled: a compiled dequantizer keeps the dtype it was traced with, and the bf16 rows convert this decoder
    fp32_config = Code2WavEngineConfig(stateful=False, cuda_graphs=False, fast_kernels=False, compile=False,
                                       max_batch_size=512, max_frames_per_forward=args.max_frames)
    engine = Code2WavEngine(decoder, fp32_config)
    ref = whole(decoder, streams)
    kind = args.checkpoint or ("tiny random" if args.tiny else "released shapes, random weights")
    print(f"decoder: {kind}, receptive field {rf} frames; "
          f"{args.streams} x {args.frames} frames; reference decoded in {time.perf_counter() - t0:.1f} s", flush=True)

    rows = []

    def add(name: str, ctx, cost: float, metrics: dict) -> None:
        rows.append(dict(name=name, left_context=ctx, cost=cost, **metrics))
        m = metrics
        print(f"{name:<34} ctx {ctx!s:>4}  cost x{cost:4.2f}  max|err| {m['max_abs']:.2e}  SNR {m['snr_db']:6.1f} dB  "
              f"worst chunk {m['worst_chunk_snr_db']:6.1f} dB  chunk 0 max|err| {m['first_chunk_max_abs']:.1e}",
              flush=True)

    for ctx in [int(c) for c in args.contexts.split(",")]:
        schedule = ChunkSchedule(first_chunk_frames=args.first, steady_chunk_frames=args.steady, left_context_frames=ctx)
        out, spans, cost = chunked(engine, streams, schedule)
        add("default schedule, fp32", ctx, cost, compare(ref, out, spans))
    out, spans = official_chunked(engine, streams)
    add("official chunked_decode 300/25, fp32", 25, 1 + 25 * (len(spans[0]) - 1) / args.frames,
        compare(ref, out, spans))
    if not args.no_bf16:
        decoder.to(torch.bfloat16)
        add("whole utterance, bf16 (eager modules)", "-", 1.0,
            compare(ref, whole(decoder, streams), [[(0, args.frames)]] * args.streams))
        bf16 = Code2WavEngine(decoder, dataclasses.replace(fp32_config, fast_kernels=True, compile=on_cuda))
        whole_bf16 = whole(bf16.decoder, streams)
        kernels = " (fused kernels)" if bf16.fast_kernels else ""
        add(f"whole utterance, bf16{kernels}", "-", 1.0, compare(ref, whole_bf16, [[(0, args.frames)]] * args.streams))
        for ctx in (25, 50, 72):
            schedule = ChunkSchedule(first_chunk_frames=args.first, steady_chunk_frames=args.steady,
                                     left_context_frames=ctx)
            out, spans, cost = chunked(bf16, streams, schedule)
            add(f"default schedule, bf16{kernels} vs fp32 whole", ctx, cost, compare(ref, out, spans))
            add(f"default schedule, bf16{kernels} vs bf16 whole", ctx, cost, compare(whole_bf16, out, spans))
    print(f"done in {time.perf_counter() - t0:.1f} s")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
    meta = dict(command=command, device=device_name, torch=torch.__version__, date=date, decoder=kind,
                frames=args.frames, streams=args.streams, first=args.first, steady=args.steady, seed=args.seed,
                receptive_field_frames=rf)
    (out_dir / f"code2wav_fidelity_{stamp}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"command: `{command}`  ", f"device: {device_name}, torch {torch.__version__}, {date}  ",
             f"decoder: {kind}; {args.streams} random code streams x {args.frames} frames, "
             f"schedule first {args.first} -> doubling -> "
             f"steady {args.steady}; receptive field {rf} frames", "",
             "| decode | left ctx | cost (decoded/new) | max abs err | SNR dB | worst chunk SNR dB | chunk 0 max err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['left_context']} | {r['cost']:.2f} | {r['max_abs']:.2e} | {r['snr_db']:.1f} | "
                     f"{r['worst_chunk_snr_db']:.1f} | {r['first_chunk_max_abs']:.1e} |")
    md = "\n".join(lines) + "\n"
    (out_dir / f"code2wav_fidelity_{stamp}.md").write_text(md)
    print("\n" + md)


if __name__ == "__main__":
    main()
