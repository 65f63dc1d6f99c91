"""Every Talker and Code2Wav replica's engine counters since it started, inside a running Serve app.

A scale-out run compares N GPUs with one: when each GPU carries less than one GPU alone, this says where, per
replica: the Talker's step (engine thread, blocked on the device, the device's own time), its mean batch (are the
streams spread evenly?), and each Code2Wav's chunks continued from their stream's state against decoded fresh
(stream affinity: deployments/ingress/placement.py). The figures are per step or per chunk, so a run whose levels
put the same streams on each GPU compares directly with the one-GPU run (`bench/gpu_serving_path.sh`'s stats).

    python -m bench.replica_stats --out stats.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bench.serve_engine_stats import code2wav_work, talker_step_figures

# Code2Wav's counters: totals since start (stream affinity: chunks decoded from their state, fresh, evicted; calls
# that named a replica and landed there or elsewhere) and the work they took
_CODE2WAV_COUNTS = ("batches", "chunks", "continued", "fresh", "evicted", "named_here", "named_elsewhere",
                    "new_frames", "decoded_frames", "padded_frames", "busy_s")


def talker_summary(stats: dict) -> dict:
    """One Talker replica's per-step figures since it started (from `Talker.engine_stats`)."""
    return talker_step_figures({}, stats)


def code2wav_summary(stats: dict) -> dict:
    """One Code2Wav replica's totals since it started, with the work per new frame (left context and padding)."""
    return {**{k: stats.get(k) for k in _CODE2WAV_COUNTS}, **code2wav_work({}, stats)}


async def every_replica(handle, replicas: int, tries: int = 128) -> dict[str, dict]:
    """Each replica's `engine_stats`, by replica name. Calls go by load (or at random): ask until `replicas`
    distinct ones answered, or give up after `tries` calls with those that did."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        stats = await handle.engine_stats.remote()
        seen[stats["replica"]] = stats
        if len(seen) >= replicas:
            break
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-tts")
    ap.add_argument("--app", default="tts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import ray
    from ray import serve

    from deployments.constants import CODE2WAV_DEPLOYMENT_NAME, TALKER_DEPLOYMENT_PREFIX

    ray.init(address="auto", namespace="serve", log_to_driver=False, logging_level="ERROR")
    talker_name = TALKER_DEPLOYMENT_PREFIX + args.model
    deployments = serve.status().applications[args.app].deployments

    def running(name: str) -> int:
        return deployments[name].replica_states.get("RUNNING", 1) if name in deployments else 0

    async def read() -> tuple[dict, dict]:
        # inside an event loop: a throughput-optimized Serve's handles route on the caller's loop
        talker = serve.get_deployment_handle(talker_name, app_name=args.app)
        talkers = await every_replica(talker, running(talker_name))
        code2wavs = {}
        if running(CODE2WAV_DEPLOYMENT_NAME):
            code2wav = serve.get_deployment_handle(CODE2WAV_DEPLOYMENT_NAME, app_name=args.app)
            code2wavs = await every_replica(code2wav, running(CODE2WAV_DEPLOYMENT_NAME))
        return talkers, code2wavs

    talkers, code2wavs = asyncio.run(read())
    report = {"talker": {name: talker_summary(s) for name, s in sorted(talkers.items())},
              "code2wav": {name: code2wav_summary(s) for name, s in sorted(code2wavs.items())}}
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
