"""Batch jobs beside real-time traffic, against a running server: does a job use only the capacity real-time
requests leave idle (docs/serving.md, "Batch jobs")?

    python -m bench.priority --url http://127.0.0.1:8000 --rate 90 --seconds 60 --items 1000 --out priority.json

1. the job alone: `--items` speech requests (`--frames` frames each, `response_format` pcm) as one batch job;
   items/s from its submission to its completion;
2. real-time alone: `bench.loadgen` open loop at `--rate` requests/s for `--seconds` (streamed, the same frames);
3. both: a new job is submitted, then the same open loop runs; items/s of the job while the loop's arrivals last.
Writes {"realtime_rate", "ttfa_p95_ms_without_job", "ttfa_p95_ms_with_job", "job_items_per_s_alone",
"job_items_per_s_beside_realtime", ...}. The server must accept `suppress_eos` (fixed lengths on random weights).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

STATUS_POLL_S = 0.5


def submit(http: httpx.Client, items: int, frames: int, model: str, voice: str) -> str:
    body = {"requests": [{"model": model, "voice": voice, "input": f"Batch item {i}: a sentence read at low priority.",
                          "response_format": "pcm", "max_new_tokens": frames, "suppress_eos": True, "seed": i}
                         for i in range(items)]}
    r = http.post("/v1/audio/speech/batches", json=body)
    r.raise_for_status()
    return r.json()["id"]


def completed(http: httpx.Client, job: str) -> dict:
    r = http.get(f"/v1/audio/speech/batches/{job}")
    r.raise_for_status()
    return r.json()


def job_alone(http: httpx.Client, args) -> float:
    t0 = time.monotonic()
    job = submit(http, args.items, args.frames, args.model, args.voice)
    while (status := completed(http, job))["status"] in ("queued", "running"):
        time.sleep(STATUS_POLL_S)
    if status["completed"] != args.items:
        raise SystemExit(f"the job alone ended {status}")
    return args.items / (time.monotonic() - t0)


def open_loop(args, out: Path) -> dict:
    """bench.loadgen at --rate for --seconds; -> its one point."""
    cmd = [sys.executable, "-m", "bench.loadgen", "--url", args.url, "--mode", "open", "--rate", str(args.rate),
           "--requests", str(int(args.rate * args.seconds)), "--max-new-tokens", str(args.frames), "--fixed-length",
           "--model", args.model, "--voice", args.voice, "--processes", str(args.processes), "--no-plots",
           "--progress", "none", "--no-stop", "--out", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["points"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rate", type=float, required=True, help="real-time requests/s (about half of capacity)")
    ap.add_argument("--seconds", type=float, default=60, help="of real-time arrivals per run")
    ap.add_argument("--items", type=int, default=1000)
    ap.add_argument("--frames", type=int, default=75)
    ap.add_argument("--model", default="tts-1")
    ap.add_argument("--voice", default="vivian")
    ap.add_argument("--processes", type=int, default=2, help="bench.loadgen's worker processes")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="priority-"))
    with httpx.Client(base_url=args.url, timeout=120) as http:
        alone = job_alone(http, args)
        without = open_loop(args, work / "without")
        job = submit(http, args.items, args.frames, args.model, args.voice)
        before, t0 = completed(http, job)["completed"], time.monotonic()
        beside = open_loop(args, work / "with")
        after, t1 = completed(http, job)["completed"], time.monotonic()
        http.delete(f"/v1/audio/speech/batches/{job}")  # what is left of it is not measured
    report = {
        "realtime_rate": args.rate, "seconds": args.seconds, "frames": args.frames, "items": args.items,
        "ttfa_p95_ms_without_job": without["ttfa_ms"]["p95"], "ttfa_p95_ms_with_job": beside["ttfa_ms"]["p95"],
        "failures_without_job": without.get("failed", 0), "failures_with_job": beside.get("failed", 0),
        "job_items_per_s_alone": round(alone, 2),
        "job_items_per_s_beside_realtime": round((after - before) / (t1 - t0), 2),
    }
    report["ttfa_p95_change"] = round(report["ttfa_p95_ms_with_job"] / report["ttfa_p95_ms_without_job"] - 1, 3)
    report["job_share_of_alone"] = round(report["job_items_per_s_beside_realtime"] / report["job_items_per_s_alone"], 3)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
