"""Load generator for `POST /v1/audio/speech` (streaming): closed or open loop, a sweep of levels.

    # closed loop: c concurrent streams, each sending its next request when its last one ends
    python -m bench.loadgen --url http://127.0.0.1:8000 --mode closed --concurrency 1,4,16,64 \\
        --requests 16 --requests-per-level 2 --max-new-tokens 75 --fixed-length --out bench/out/closed
    # open loop: Poisson arrivals at r requests/s (20 s of arrivals per rate here)
    python -m bench.loadgen --url http://127.0.0.1:8000 --mode open --rate 1,10,20,40 \\
        --requests 16 --requests-per-level 20 --max-new-tokens 75 --fixed-length --out bench/out/open

With --processes N the requests are sent and their streams read by N worker processes (bench/loadgen/fanout.py):
one event loop reading hundreds of streams falls behind, and its lag lands in every latency it measures.

Writes OUT/results.json (every point's summary and per-request rows), OUT/results.md and, with
matplotlib, OUT/latency.png, OUT/throughput.png, OUT/continuity.png; JSON and markdown are rewritten
after every point. The sweep stops after the first point with failures (--stop-failure-rate), when the
TTFA p95 passes --stop-ttfa-p95-ms, or when --max-seconds is spent (running requests are cancelled).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

import aiohttp

from .client import SpeechClient, SpeechSettings
from .fanout import ProcessPoolClient
from .progress import make_progress
from .report import build_document, write_results
from .runner import SweepConfig, SweepOutcome, sweep
from .sentences import TextPool, load_sentences


def _levels(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(",") if v.strip())
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive comma-separated numbers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="server root (the API is under /v1)")
    ap.add_argument("--mode", choices=["closed", "open"], default="closed")
    ap.add_argument("--concurrency", type=_levels, default=(1, 4, 16), help="closed loop levels, e.g. 1,4,16")
    ap.add_argument("--rate", type=_levels, default=(1, 10, 20), help="open loop levels in requests/s")
    ap.add_argument("--requests", type=int, default=16, help="requests per point (at least)")
    ap.add_argument("--stagger-s", type=float, default=0.0,
                    help="closed loop: spread the streams' starts over this many seconds (0: all at once)")
    ap.add_argument("--requests-per-level", type=float, default=0.0,
                    help="more requests at higher levels: closed n >= k*c, open n >= k*r (k s of arrivals)")
    ap.add_argument("--warmup", type=int, default=2, help="requests before the sweep, not measured")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="codec frames per request (80 ms each)")
    ap.add_argument("--fixed-length", action="store_true",
                    help="suppress EOS: exactly --max-new-tokens frames; a shorter stream counts as a failure")
    ap.add_argument("--model", default="tts-1")
    ap.add_argument("--voice", default="vivian")
    ap.add_argument("--language", choices=["en", "zh", "mix"], default="mix", help="which sentences to speak")
    ap.add_argument("--sentences", type=Path, default=None, help="sentence file (default: the shipped set)")
    ap.add_argument("--response-format", choices=["pcm", "wav"], default="pcm")
    ap.add_argument("--stream-format", choices=["audio", "sse"], default="audio")
    ap.add_argument("--extra", type=json.loads, default={}, help="JSON merged into every request body")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--max-seconds", type=float, default=None, help="budget of the whole sweep, seconds")
    ap.add_argument("--stop-failure-rate", type=float, default=0.0,
                    help="stop after a point whose failure rate exceeds this (default 0: any failure)")
    ap.add_argument("--no-stop", action="store_true", help="run every level whatever fails")
    ap.add_argument("--stop-ttfa-p95-ms", type=float, default=None)
    ap.add_argument("--continuity-threshold", type=float, default=0.1, help="seconds of deficit still continuous")
    ap.add_argument("--rebuffer-resume-s", type=float, default=0.0,
                    help="rebuffering player: audio buffered before it resumes after a stall")
    ap.add_argument("--processes", type=int, default=1,
                    help="worker processes that send the requests and read the streams (the parent only schedules): "
                         "one event loop falls behind at hundreds of streams")
    ap.add_argument("--seed", type=int, default=0, help="sentence order and Poisson arrivals")
    ap.add_argument("--label", default="", help="free text kept in the results (device, config)")
    ap.add_argument("--progress", choices=["auto", "tqdm", "plain", "none"], default="auto")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.fixed_length and not args.max_new_tokens:
        ap.error("--fixed-length needs --max-new-tokens")
    if args.processes < 1:
        ap.error("--processes must be >= 1")
    if args.stagger_s < 0:
        ap.error("--stagger-s must be >= 0")
    return args


async def _server_models(url: str) -> object:
    try:
        async with aiohttp.ClientSession() as s, s.get(url.rstrip("/") + "/v1/models",
                                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
            data = await r.json()
            return [{k: m.get(k) for k in ("id", "task_type", "max_seq_len")} for m in data.get("data", [])]
    except Exception as e:
        return f"unavailable: {type(e).__name__}: {e}"


async def amain(args: argparse.Namespace) -> SweepOutcome:
    settings = SpeechSettings(model=args.model or None, voice=args.voice or None,
                              response_format=args.response_format, stream_format=args.stream_format,
                              max_new_tokens=args.max_new_tokens, fixed_length=args.fixed_length,
                              extra=args.extra, timeout_s=args.timeout)
    cfg = SweepConfig(mode=args.mode, levels=args.concurrency if args.mode == "closed" else args.rate,
                      requests=args.requests, requests_per_level=args.requests_per_level, warmup=args.warmup,
                      seed=args.seed, max_seconds=args.max_seconds,
                      stop_failure_rate=None if args.no_stop else args.stop_failure_rate,
                      stop_ttfa_p95_ms=args.stop_ttfa_p95_ms, continuity_threshold_s=args.continuity_threshold,
                      rebuffer_resume_s=args.rebuffer_resume_s, stagger_s=args.stagger_s)
    sentences = load_sentences(args.sentences, args.language)
    pool = TextPool(sentences)
    meta = {
        "label": args.label, "url": args.url,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(), "python": platform.python_version(),
        "command": "python -m bench.loadgen " + shlex.join(sys.argv[1:]),
        "settings": asdict(settings), "sweep": asdict(cfg), "processes": args.processes,
        "texts": f"{len(sentences)} {args.language} sentences from {args.sentences or 'bench/loadgen/sentences.txt'}",
        "server_models": await _server_models(args.url),
    }

    def on_point(outcome: SweepOutcome) -> None:
        s = outcome.summaries[-1]
        print(f"{cfg.mode} {s.level:g}: ok {s.ok}/{s.ok + s.failed} failures {s.failures or 0} "
              f"TTFA p50/p95 {_ms(s.ttfa_ms.p50)}/{_ms(s.ttfa_ms.p95)} ms  E2E p95 {_ms(s.e2e_ms.p95)} ms  "
              f"{s.audio_s_per_s:.1f} audio-s/s  continuous {_share(s.continuous_share)}", flush=True)
        write_results(build_document(meta, outcome, cfg.rebuffer_resume_s), args.out, plots=False)

    client = SpeechClient(args.url, settings) if args.processes == 1 else ProcessPoolClient(
        args.url, settings, args.processes)
    async with client:
        outcome = await sweep(client, cfg, pool.draw, on_point,
                              lambda label, total: make_progress(args.progress, label, total))
    doc = build_document(meta, outcome, cfg.rebuffer_resume_s)
    for path in write_results(doc, args.out, plots=not args.no_plots):
        print(f"wrote {path}")
    if outcome.stop_reason:
        print(f"stopped: {outcome.stop_reason}")
    return outcome


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop  # the GPU image has it; plain asyncio otherwise

        uvloop.install()
    except ImportError:
        pass
    outcome = asyncio.run(amain(args))
    return 0 if any(s.ok for s in outcome.summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
