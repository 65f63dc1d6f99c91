"""The engines' own counters inside a running Serve app: every replica since it started, or one replica over a window.

Since start (the default): each Talker and Code2Wav replica's figures per step or per chunk, so that a scale-out
run whose levels put the same streams on each GPU compares directly with the one-GPU run. Per replica: the
Talker's step (engine thread, blocked on the device, the device's own time), its mean batch (are the streams
spread evenly?), and each Code2Wav's chunks continued from their stream's state against decoded fresh (stream
affinity: deployments/ingress/placement.py), and, when the app serves word timestamps, each Aligner's host time per
piece, device-thread time per audio second and per forward, mean batch and the pieces' wait for a forward.

`--seconds N`: one Talker replica and one Code2Wav replica (the same one at both ends) read twice, N seconds apart:
the served step time over that window, to compare with `bench/pipeline.py`'s in-process step at the same batch,
Code2Wav's decode calls, chunks per call and busy share (and the same of the Talker's first-chunk decoder, when it
has one).

    python -m bench.replica_stats --out stats.json                 # every replica, since start
    python -m bench.replica_stats --seconds 10 --out window.json   # one replica of each, over 10 s

Since start, the output also holds each Talker and ingress replica's event-loop lag as counted so far
(`event_loop_lag`: deployments/loop_lag.py); `--lag-between A.json B.json` gives each replica's lag between two
such outputs (a level's window: one read before it, one after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from deployments import loop_lag
from stages.talker import step_clock
from stages.talker.step_clock import DeviceClockStats

# Code2Wav's counters: totals since start (stream affinity: chunks decoded from their state, fresh, evicted; calls
# that named a replica and landed there or elsewhere) and the work they took
_CODE2WAV_COUNTS = ("batches", "chunks", "continued", "fresh", "evicted", "named_here", "named_elsewhere",
                    "new_frames", "decoded_frames", "padded_frames", "busy_s")


def talker_step_figures(before: dict, after: dict) -> dict:
    """The Talker engine's figures per step and per request between two reads of its counters (`Talker.
    engine_stats`); `before={}`: since the engine started."""
    def delta(key: str) -> float:  # a counter's growth between the reads
        return after.get(key, 0) - before.get(key, 0)  # 0: a counter this engine does not keep

    per_step = max(delta("steps"), 1)
    return {
        "steps": delta("steps"),
        "engine_thread_step_ms": round(delta("step_seconds") / per_step * 1e3, 2),
        # of it, blocked until the step's output was ready (the rest: host work and waiting for the GIL)
        "device_wait_ms": round(delta("device_wait_seconds") / per_step * 1e3, 2),
        # steps whose output was ready when the engine thread came to read it (the device idled meanwhile)
        "host_bound_share": round(delta("host_bound_steps") / per_step, 3),
        # the device's clock: a step's own GPU time, the gaps between steps per step (prefills; the device
        # waiting for the host's launch) and the idle gaps over 1 ms (stages/talker/step_clock.py)
        **{k: round(v, 3) for k, v in step_clock.window_ms(DeviceClockStats(**before.get("device_clock", {})),
                                                          DeviceClockStats(**after.get("device_clock", {}))).items()},
        "mean_batch": round(delta("frames") / per_step, 1),
        # prefills run and requests admitted (admitted / prefills: the prefill batch)
        "prefills": delta("prefills"), "admitted": delta("admitted"),
        # inside the engine, for the requests admitted / first-chunked between the reads: add -> admission and
        # add -> first chunk with frames (the rest of a client's time to first audio is the serving path)
        "engine_admission_wait_ms": _mean_ms(before, after, "admission_wait_seconds", "admitted"),
        # of it, until the engine thread took the request from its command queue (the rest: in its queue)
        "engine_command_wait_ms": _mean_ms(before, after, "command_wait_seconds", "admitted"),
        "engine_first_chunk_ms": _mean_ms(before, after, "first_chunk_seconds", "first_chunks"),
        # the engine's last steps one by one at the later read (stages/talker/step_clock.py, `recent_steps`): launch
        # intervals and device times (p50, p95, p99, max ms), stalls over 30 ms and the device's share of them
        "recent_steps": after.get("recent_steps") or {},
    }


def code2wav_work(before: dict, after: dict) -> dict:
    """A Code2Wav replica's chunks per decode call and frames decoded and padded per new frame (left context
    and padding) between two reads of its counters; `before={}`: since it started."""
    def delta(key: str) -> float:
        return after[key] - before.get(key, 0)

    new = max(delta("new_frames"), 1)
    return {"chunks_per_call": round(delta("chunks") / max(delta("batches"), 1), 1),
            "decoded_per_new_frame": round(delta("decoded_frames") / new, 2),
            "padded_per_new_frame": round(delta("padded_frames") / new, 2)}


def talker_summary(stats: dict) -> dict:
    """One Talker replica's per-step figures since it started (from `Talker.engine_stats`)."""
    return talker_step_figures({}, stats)


def code2wav_summary(stats: dict) -> dict:
    """One Code2Wav replica's totals since it started, with the work per new frame (left context and padding)."""
    return {**{k: stats.get(k) for k in _CODE2WAV_COUNTS}, **code2wav_work({}, stats)}


def aligner_summary(stats: dict) -> dict:
    """One Aligner replica since it started: where a timestamp's time goes (host preparation per piece, the device
    thread's time per audio second and per forward, the wait between being prepared and timed)."""
    pieces, forwards = stats.get("pieces") or 0, stats.get("forwards") or 0
    return {
        "pieces": pieces, "forwards": forwards, "audio_s": round(stats.get("audio_s", 0.0), 1),
        "mean_batch": round(pieces / forwards, 2) if forwards else None,
        "prepare_ms_per_piece": _mean_ms({}, stats, "prepare_s", "prepared"),
        "forward_ms": _mean_ms({}, stats, "forward_s", "forwards"),
        "max_forward_ms": round(stats.get("max_forward_s", 0.0) * 1e3, 1),
        "late_graphs": stats.get("late_graphs", 0),
        "late_traces": stats.get("late_traces", 0),
        "late_kernels": stats.get("late_kernels", 0),
        "late_conv_shapes": stats.get("late_conv_shapes", 0),
        "late_spectrogram_shapes": stats.get("late_spectrogram_shapes", 0),
        "forward_ms_per_audio_s": round(stats["forward_s"] / stats["audio_s"] * 1e3, 3) if stats.get("audio_s") else None,
        "queue_wait_ms_per_piece": _mean_ms({}, stats, "queue_wait_s", "pieces"),
    }


def window_report(before: dict, after: dict, c2w_before: dict, c2w_after: dict, wall: float) -> dict:
    """One Talker replica and one Code2Wav replica between two reads `wall` seconds apart."""
    steps = after["steps"] - before["steps"]
    report = {
        "window_s": round(wall, 2),
        "step_ms": round(wall / max(steps, 1) * 1e3, 2),  # wall per step: what a stream sees
        **talker_step_figures(before, after),
        "prefill_share": round((after["prefill_seconds"] - before["prefill_seconds"]) / wall, 4),  # their launches
        "running": after["running"], "waiting": after["waiting"],
        "code2wav": _code2wav_window(c2w_before, c2w_after, wall),
    }
    if "first_chunk_decoder" in before:  # the Talker's own decodes of first chunks, beside its steps
        report["talker_first_chunk_decoder"] = _code2wav_window(before["first_chunk_decoder"],
                                                                after["first_chunk_decoder"], wall)
    return report


async def every_replica(handle, replicas: int, tries: int = 128, method: str = "engine_stats") -> dict[str, dict]:
    """Each replica's `engine_stats` (or `method`), by replica name. Calls go by load (or at random): ask until
    `replicas` distinct ones answered, or give up after `tries` calls with those that did."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        stats = await getattr(handle, method).remote()
        seen[stats["replica"]] = stats
        if len(seen) >= replicas:
            break
    return seen


async def _same_replica(handle, replica: str, tries: int = 32) -> dict:
    """Counters of the replica the window's first read came from (with several replicas the router picks one per
    call: the difference of two replicas' counters means nothing)."""
    for _ in range(tries):
        stats = await handle.engine_stats.remote()
        if stats["replica"] == replica:
            return stats
    raise RuntimeError(f"{tries} reads never reached replica {replica} again")


def _code2wav_window(before: dict, after: dict, wall: float) -> dict:
    """One Code2Wav replica over the window: decode calls, chunks per call, the share of the window it spent
    decoding (waiting on the GPU included), and the work per new frame (left context and padding included)."""
    d = {k: after[k] - before[k] for k in ("batches", "forwards", "new_frames", "busy_s")}
    work = code2wav_work(before, after)
    return {"decode_calls": d["batches"], "chunks_per_call": work["chunks_per_call"], "forwards": d["forwards"],
            "busy_share": round(d["busy_s"] / wall, 3),
            "decoded_per_new_frame": work["decoded_per_new_frame"],
            "padded_per_new_frame": work["padded_per_new_frame"],
            "new_frames_per_s": round(d["new_frames"] / wall, 1)}


def lag_between(before: dict, after: dict) -> dict:
    """Each Talker and ingress replica's event-loop lag between two since-start outputs (a replica absent from
    `before` started in between: since its start)."""
    lags_before, lags_after = before.get("event_loop_lag", {}), after.get("event_loop_lag", {})
    return {kind: {name: loop_lag.window(lags_before.get(kind, {}).get(name), snap) for name, snap in sorted(snaps.items())}
            for kind, snaps in lags_after.items()}


def _mean_ms(before: dict, after: dict, seconds: str, count: str) -> float | None:
    n = after[count] - before.get(count, 0)
    return round((after[seconds] - before.get(seconds, 0)) / n * 1e3, 1) if n else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-tts")
    ap.add_argument("--app", default="tts")
    ap.add_argument("--seconds", type=float, default=None,
                    help="read one replica of each stage twice, this far apart (default: every replica since start)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--lag-between", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                    help="two since-start outputs: each replica's event-loop lag between them (no Ray)")
    args = ap.parse_args()
    if args.lag_between:
        report = lag_between(*(json.loads(Path(f).read_text()) for f in args.lag_between))
        print(json.dumps(report, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
        return

    import ray
    from ray import serve

    from deployments.constants import (
        ALIGNER_DEPLOYMENT_NAME,
        CODE2WAV_DEPLOYMENT_NAME,
        INGRESS_DEPLOYMENT_NAME,
        TALKER_DEPLOYMENT_PREFIX,
    )

    ray.init(address="auto", namespace="serve", log_to_driver=False, logging_level="ERROR")
    talker_name = TALKER_DEPLOYMENT_PREFIX + args.model
    deployments = serve.status().applications[args.app].deployments

    def running(name: str) -> int:
        return deployments[name].replica_states.get("RUNNING", 1) if name in deployments else 0

    # inside an event loop: a throughput-optimized Serve's handles route on the caller's loop and refuse calls
    # made outside one
    async def since_start() -> dict:
        talker = serve.get_deployment_handle(talker_name, app_name=args.app)
        talkers = await every_replica(talker, running(talker_name))
        code2wavs = {}
        if running(CODE2WAV_DEPLOYMENT_NAME):
            code2wav = serve.get_deployment_handle(CODE2WAV_DEPLOYMENT_NAME, app_name=args.app)
            code2wavs = await every_replica(code2wav, running(CODE2WAV_DEPLOYMENT_NAME))
        aligners = {}
        if running(ALIGNER_DEPLOYMENT_NAME):
            aligner = serve.get_deployment_handle(ALIGNER_DEPLOYMENT_NAME, app_name=args.app)
            aligners = await every_replica(aligner, running(ALIGNER_DEPLOYMENT_NAME))
        ingress = serve.get_deployment_handle(INGRESS_DEPLOYMENT_NAME, app_name=args.app)
        ingresses = await every_replica(ingress, running(INGRESS_DEPLOYMENT_NAME), method="replica_stats")
        lags = {"talker": {n: s["event_loop_lag"] for n, s in talkers.items() if "event_loop_lag" in s},
                "ingress": {n: s["event_loop_lag"] for n, s in ingresses.items()}}
        return {"event_loop_lag": lags,
                "talker": {name: talker_summary(s) for name, s in sorted(talkers.items())},
                "code2wav": {name: code2wav_summary(s) for name, s in sorted(code2wavs.items())},
                **({"aligner": {name: aligner_summary(s) for name, s in sorted(aligners.items())}} if aligners else {})}

    async def window() -> dict:
        talker = serve.get_deployment_handle(talker_name, app_name=args.app)
        code2wav = serve.get_deployment_handle(CODE2WAV_DEPLOYMENT_NAME, app_name=args.app)
        first = await asyncio.gather(talker.engine_stats.remote(), code2wav.engine_stats.remote())
        t0 = time.perf_counter()
        await asyncio.sleep(args.seconds)
        last = await asyncio.gather(_same_replica(talker, first[0]["replica"]),
                                    _same_replica(code2wav, first[1]["replica"]))
        return window_report(first[0], last[0], first[1], last[1], time.perf_counter() - t0)

    report = asyncio.run(since_start() if args.seconds is None else window())
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
