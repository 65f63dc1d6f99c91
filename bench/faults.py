"""Faults under load against a running server: kill one Talker or Code2Wav replica (or redeploy) mid-stream.

Opens `--streams` long streams (raw PCM and, every fourth, SSE), waits until every one has audio in hand, then:
- `--fault talker`: reads every Talker replica's rows (`engine_stats`), kills the one with the most with
  `ray.kill` (its process dies as in a crash). Only its streams may end, each visibly: a raw stream without its
  terminating chunk, an SSE stream with an error event. `other_streams_lost` = failed streams beyond the rows the
  killed replica held. `ready_after_s`: until Serve reports every Talker replica RUNNING again.
- `--fault code2wav`: kills one Code2Wav replica; every stream must complete (decode state is a cache); `max_gap_s`
  is the worst playback stall of any stream (arrival later than the audio already received would play out).
- `--fault redeploy --config FILE`: `serve deploy FILE` (a changed config) while the streams run; `cut` counts
  streams that did not receive all their audio, `replicas_started` the Talker and Code2Wav replicas the deploy
  started: an `args` change rolls every deployment (Serve versions an app by its `args`), a change of Serve's
  options in the config's `deployments:` section starts none (docs/serving.md, "What a redeploy restarts").

    python -m bench.faults --url http://127.0.0.1:8000 --fault talker --streams 256 --out talker_kill.json

Needs Ray on the host of the server (`ray.init(address="auto")`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME


@dataclass
class Stream:
    sse: bool
    expected_bytes: int
    received: int = 0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes of audio so far)
    outcome: str = "running"  # complete | visible_error | short_clean (a silent cut: must never happen)
    detail: str = ""
    first_audio: asyncio.Event = field(default_factory=asyncio.Event)

    def note(self, n: int) -> None:
        self.received += n
        self.arrivals.append((time.monotonic(), self.received))
        self.first_audio.set()

    def max_stall_s(self) -> float:
        """Worst lateness of an arrival against playback of the audio received before it (16-bit mono)."""
        if not self.arrivals:
            return 0.0
        t0, worst, had = self.arrivals[0][0], 0.0, self.arrivals[0][1]
        for t, total in self.arrivals[1:]:
            worst = max(worst, t - (t0 + had / 2 / SAMPLE_RATE))
            had = total
        return worst


async def run_stream(session: aiohttp.ClientSession, url: str, body: dict, s: Stream) -> None:
    try:
        async with session.post(f"{url}/v1/audio/speech", json=body) as resp:
            if resp.status != 200:
                s.outcome, s.detail = "visible_error", f"HTTP {resp.status}"
                s.first_audio.set()
                return
            if not s.sse:
                async for data in resp.content.iter_any():
                    s.note(len(data))
            else:
                import base64
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[5:])
                    if event.get("type") == "speech.audio.delta":
                        s.note(len(base64.b64decode(event["audio"])))
                    elif event.get("type") == "speech.audio.error":
                        s.outcome, s.detail = "visible_error", event.get("error", {}).get("code", "")
                        s.first_audio.set()
                        return
        s.outcome = "complete" if s.received >= s.expected_bytes else "short_clean"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError) as e:
        s.outcome, s.detail = "visible_error", type(e).__name__
    s.first_audio.set()


def _deployment_names(app: str) -> dict[str, str]:
    from ray import serve
    names = list(serve.status().applications[app].deployments)
    return {"talker": next(n for n in names if n.startswith("Talker:")),
            "code2wav": next(n for n in names if n == "Code2Wav")}


def _replica_actors(name: str) -> set[str]:
    import ray
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and f"#{name}#" in a["name"]}


def _replaced(app: str, name: str, want: int, before: set[str], gone: str) -> bool:
    """A replica started after the kill, the killed one is gone, and Serve counts `want` RUNNING replicas of a
    HEALTHY deployment (right after a kill the controller may not have noticed yet: status alone would say ready)."""
    from ray import serve
    now = _replica_actors(name)
    if gone in now or not (now - before):
        return False
    d = serve.status().applications[app].deployments[name]
    return d.status == "HEALTHY" and d.replica_states.get("RUNNING", 0) >= want


async def _replica_rows(app: str, name: str, replicas: int) -> dict[str, int]:
    from ray import serve
    handle = serve.get_deployment_handle(name, app_name=app)
    rows: dict[str, int] = {}
    for _ in range(replicas * 32):
        if len(rows) == replicas:
            break
        stats = await handle.engine_stats.remote()
        rows[stats["replica"]] = stats.get("running", 0)
    return rows


def _kill_replica(app: str, name: str, replica: str | None) -> str:
    import ray
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["namespace"] == "serve" and f"#{name}#" in a["name"]
              and (replica is None or a["name"].endswith(f"#{replica}"))]
    target = actors[0]["name"]
    ray.kill(ray.get_actor(target, namespace="serve"), no_restart=True)
    return target


def _redeploy(config_path: str, app: str, timeout_s: float) -> tuple[float, str]:
    """`serve deploy` of the changed config, as an operator deploys it (the declarative path: Serve versions the
    app by its import path, runtime env and `args`, so an `args` change rolls every deployment while a change of
    Serve's own options in the config's `deployments:` section updates replicas in place). Where the cluster has no
    dashboard agent to deploy through, the same app through Serve's Python API (`serve.run`, which versions every
    deployment anew: everything rolls). -> (seconds until every deployment is HEALTHY again, the path taken)."""
    import os
    import subprocess

    from ray import serve

    env = dict(os.environ)
    if os.path.exists(os.path.expanduser("~/.ray/auth_token")) and env.get("RAY_AUTH_MODE") != "disabled":
        env["RAY_AUTH_MODE"] = "token"  # a cluster that wrote a token wants it from the CLI too
    deployed_before = serve.status().applications[app].last_deployed_time_s
    t0 = time.monotonic()
    try:
        deployed = subprocess.run(["serve", "deploy", config_path], env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        failure = (deployed.stderr.strip() or deployed.stdout.strip())[-300:] if deployed.returncode else ""
        unreachable = "onnect" in failure  # Connection refused / ConnectionError: no dashboard agent to deploy to
    except FileNotFoundError as e:  # no `serve` CLI on PATH
        failure, unreachable = str(e), True
    if failure and not unreachable:
        raise RuntimeError(f"serve deploy {config_path} failed: {failure}")  # the config or the cluster refused it
    if failure:
        import yaml

        from deployments.builder import build_app

        print(f"serve deploy could not reach the cluster ({failure}); deploying through serve.run")
        with open(config_path) as f:
            spec = next(a for a in yaml.safe_load(f)["applications"] if a["name"] == app)
        # returns once the app runs; serve.run does not move `last_deployed_time_s`
        serve.run(build_app(spec["args"]), name=app, route_prefix=spec.get("route_prefix", "/"))
        return round(time.monotonic() - t0, 1), "serve.run"
    while time.monotonic() - t0 < timeout_s:
        status = serve.status().applications[app]
        if status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"{app} failed to deploy the new config: {status.message}")
        # the new config taken (its deploy time moved on), then applied: every deployment HEALTHY again
        if (status.last_deployed_time_s > deployed_before and status.status == "RUNNING"
                and all(d.status == "HEALTHY" for d in status.deployments.values())):
            return round(time.monotonic() - t0, 1), "serve deploy"
        time.sleep(0.5)
    raise TimeoutError(f"{app} did not run the new config within {timeout_s:g} s")


async def main_async(args) -> dict:
    import ray
    ray.init(address="auto", namespace="serve", log_to_driver=False, logging_level="ERROR")
    names = _deployment_names(args.app)
    from ray import serve
    replicas = {k: serve.status().applications[args.app].deployments[n].replica_states.get("RUNNING", 0)
                for k, n in names.items()}
    expected = args.frames * SAMPLES_PER_FRAME * 2
    streams = [Stream(sse=(i % 4 == 3), expected_bytes=expected) for i in range(args.streams)]
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=args.timeout)) as session:
        tasks = [asyncio.create_task(run_stream(session, args.url, {
            "model": args.model, "input": f"Fault run stream {i}: a long sentence that keeps speaking.",
            "voice": args.voice, "response_format": "pcm", "stream": True, "max_new_tokens": args.frames,
            "suppress_eos": True, "seed": i, **({"stream_format": "sse"} if s.sse else {})}, s))
            for i, s in enumerate(streams)]
        await asyncio.wait_for(asyncio.gather(*(s.first_audio.wait() for s in streams)), args.timeout)
        report: dict = {"fault": args.fault, "streams": args.streams, "frames": args.frames,
                        "replicas_before": replicas}
        before = {k: _replica_actors(n) for k, n in names.items()}
        t_fault = time.monotonic()
        if args.fault == "talker":
            rows = await _replica_rows(args.app, names["talker"], replicas["talker"])
            victim = max(rows, key=rows.get)
            report["rows_per_replica"], report["killed"] = rows, _kill_replica(args.app, names["talker"], victim)
        elif args.fault == "code2wav":
            report["killed"] = _kill_replica(args.app, names["code2wav"], None)
        else:
            report["redeploy_s"], report["redeploy_via"] = await asyncio.to_thread(_redeploy, args.config, args.app,
                                                                                  args.timeout)
        ready_after = None
        if args.fault in ("talker", "code2wav"):
            name = names[args.fault]
            while time.monotonic() - t_fault < args.timeout:  # the controller's own view of the replacement
                if _replaced(args.app, name, replicas[args.fault], before[args.fault], report["killed"]):
                    ready_after = round(time.monotonic() - t_fault, 1)
                    break
                await asyncio.sleep(0.5)
        await asyncio.gather(*tasks)
        if args.fault == "redeploy":  # which engines the deploy restarted (a restarted engine is a stall)
            report["replicas_started"] = {k: len(_replica_actors(n) - before[k]) for k, n in names.items()}
    outcomes: dict[str, int] = {}
    for s in streams:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    failed = outcomes.get("visible_error", 0) + outcomes.get("short_clean", 0)
    report.update({"outcomes": outcomes, "ready_after_s": ready_after,
                   "max_gap_s": round(max(s.max_stall_s() for s in streams if s.outcome == "complete")
                                      if outcomes.get("complete") else 0.0, 3)})
    if args.fault == "talker":
        held = report["rows_per_replica"][report["killed"].rsplit("#", 1)[-1]]
        report.update({"visible_errors": outcomes.get("visible_error", 0), "killed_replica_rows": held,
                       "other_streams_lost": max(0, failed - held), "silent_cuts": outcomes.get("short_clean", 0)})
    elif args.fault == "code2wav":
        report["lost"] = failed
    else:
        report["cut"] = failed
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--app", default="tts")
    ap.add_argument("--model", default="tts-1")
    ap.add_argument("--voice", default="vivian")
    ap.add_argument("--fault", choices=("talker", "code2wav", "redeploy"), required=True)
    ap.add_argument("--config", help="redeploy: the changed config file for `serve deploy`")
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--frames", type=int, default=300, help="frames per stream (12.5 per audio second)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.fault == "redeploy" and not args.config:
        ap.error("--fault redeploy needs --config")
    report = asyncio.run(main_async(args))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
