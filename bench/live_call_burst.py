"""A burst of live requests into a Talker replica, on a local Ray cluster (CPU; Serve, no model work).

N live requests (WebSocket contexts' Talker requests) start at once in one caller deployment standing in for an
ingress replica: each goes through the ingress's real `LiveCalls` (deployments/ingress/live_calls.py: batched into
`Talker.generate_live_many` calls) to the real Talker deployment (deployments/talker/server.py) over the gRPC
transport the ingress uses, with Serve throughput-optimized as the fastest recipe runs it. The Talker's engine is the
tests' fake (tests/fake_engine.py: no model), so what is measured is Serve's calls and the Talker's handling of them:
per burst size, p50 / p95 / max ms from a request's start to its `LiveAdmitted` (a live first audio's `ingress_call`
+ `to_talker_call` stages and the way back), and the CPU time per request of the caller's and the Talker's processes
above their idle rate. Several bursts each, 0.5 s apart.

    python -m bench.live_call_burst --sizes 1,32,128 --bursts 10 --out live_calls.json
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from bench.burst_cli import burst_main
from bench.loadgen.metrics import Stats

APP = "live_call_burst"


def _caller_class():
    from ray import serve

    @serve.deployment(max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    class Caller:
        """An ingress replica's live requests: its mailbox and `LiveCalls`, as `TTSIngress.start_live` has them."""

        def __init__(self, talker):
            from deployments import constants as C
            from deployments.ingress.live_calls import LiveCalls
            from deployments.text_mailbox import MailboxWriter, new_mailbox
            from deployments.transport import stage_handle

            self._writer = MailboxWriter(new_mailbox())
            self._talker = talker
            self._live = LiveCalls(stage_handle(talker, "grpc"), self._writer.handle, C.LIVE_CALL_MAX_BATCH,
                                   C.LIVE_CALL_ADMISSION_WAIT_S)
            self._prompt = None

        async def burst(self, n: int, tag: str) -> list[float]:
            """ms from each of `n` requests' start to its `LiveAdmitted`; then each is ended as a context's close
            ends it (its box closed, its stream left)."""
            from deployments.messages import GenerateOptions
            from stages.contract import SynthesisRequest
            from stages.prompts import build_live_prompt

            if self._prompt is None:
                info = await self._talker.info.remote()
                self._prompt = build_live_prompt(info.config, info.tokenizer, speaker="ryan", language="english")

            async def one(i: int):
                request = SynthesisRequest(f"{tag}-{i}", self._prompt, max_frames=100)
                started = time.perf_counter()
                stream = self._live.open(request, GenerateOptions())
                await anext(stream)
                return (time.perf_counter() - started) * 1000, stream, request.request_id

            out = await asyncio.gather(*(one(i) for i in range(n)))
            for _, stream, request_id in out:
                stream.cancel()
                self._writer.close(request_id)
            return [ms for ms, _, _ in out]

        async def calls(self) -> int:
            return self._live.calls

    return Caller


def _process(name: str):
    import psutil

    pids = subprocess.run(["pgrep", "-f", f"ServeReplica:{APP}:{name}"], capture_output=True, text=True).stdout.split()
    if not pids:
        raise RuntimeError(f"no process of {name}")
    return psutil.Process(int(pids[0]))


async def _drive(sizes: list[int], bursts: int, idle_s: float) -> dict[str, dict]:
    from ray import serve

    handle = serve.get_app_handle(APP)
    await handle.burst.remote(1, "warm")
    procs = {"caller": _process("Caller"), "talker": _process("Talker")}

    def cpu() -> dict[str, float]:
        return {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}

    idle0, t0 = cpu(), time.perf_counter()
    await asyncio.sleep(idle_s)
    idle1 = cpu()
    idle = {k: (idle1[k] - idle0[k]) / (time.perf_counter() - t0) for k in idle0}
    out = {}
    for n in sizes:
        calls0, c0, t0 = await handle.calls.remote(), cpu(), time.perf_counter()
        ms: list[float] = []
        for k in range(bursts):
            ms += await handle.burst.remote(n, f"{n}-{k}")
            await asyncio.sleep(0.5)
        c1, elapsed, calls = cpu(), time.perf_counter() - t0, await handle.calls.remote() - calls0
        st = Stats.of(ms)
        cpu_ms = {k: round((c1[k] - c0[k] - idle[k] * elapsed) * 1000 / (n * bursts), 3) for k in c0}
        out[str(n)] = {"p50": round(st.p50, 2), "p95": round(st.p95, 2), "max": round(st.max, 2), "n": st.n,
                       "talker_calls_per_burst": round(calls / bursts, 2), "cpu_ms_per_request": cpu_ms}
        print(f"{n} at once: to LiveAdmitted p50 / p95 / max {st.p50:.1f} / {st.p95:.1f} / {st.max:.1f} ms, "
              f"{calls / bursts:.1f} Talker calls per burst, CPU ms per request {cpu_ms}", flush=True)
    return out


def run(sizes: list[int], bursts: int, idle_s: float = 5.0) -> dict[str, dict]:
    """Deploys the two on the connected Ray cluster, measures (the processes' idle CPU rate over `idle_s` first),
    and deletes the app."""
    from ray import serve

    from deployments.builder import build_talker_deployment
    from deployments.config import StreamingConfig, TalkerDeploymentConfig

    talker = build_talker_deployment(TalkerDeploymentConfig(
        name="burst", model=None, device="cpu", cpu_threads=1, engine_cls="tests.fake_engine:FakeTalkerEngine",
        engine_kwargs={"max_num_seqs": 1024, "max_seq_len": 512},
        deployment_config={"ray_actor_options": {"num_cpus": 0}}), StreamingConfig())
    serve.run(_caller_class().bind(talker), name=APP, route_prefix=None)
    try:
        return asyncio.run(_drive(sizes, bursts, idle_s))
    finally:
        serve.delete(APP)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")  # before Serve is imported: the fastest recipe's
    return burst_main(argv, __doc__, run, "1,32,128", "live requests starting at once", 10)


if __name__ == "__main__":
    raise SystemExit(main())
