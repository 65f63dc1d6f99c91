"""A burst of Talker requests into a Talker replica, on a local Ray cluster (CPU; Serve, no model work).

N requests start at once in one caller deployment standing in for an ingress replica: each goes through the
ingress's real `TalkerCalls` (deployments/ingress/talker_calls.py: batched into `Talker.generate_live_many` calls for
`--kind live`, WebSocket contexts' requests; `Talker.generate_many` for `--kind speech`) to the real Talker
deployment (deployments/talker/server.py) over the gRPC transport the ingress uses, with Serve throughput-optimized as
the fastest recipe runs it; `--kind speech-per-call` makes one `Talker.generate` call per request instead (the way
speech went before its calls were batched). The Talker's engine is the tests' fake (tests/fake_engine.py: no model),
so what is measured is Serve's calls and the Talker's handling of them: per burst size, p50 / p95 / max ms from a
request's start to its first item back (live: its `Admitted`, a live first audio's `ingress_call` + `to_talker_call`
stages and the way back; speech: its first codec chunk, the fake engine's one-frame first chunk), and the CPU time per
request of the caller's and the Talker's processes above their idle rate. Several bursts each, 0.5 s apart.

    python -m bench.talker_call_burst --kind speech --sizes 1,32,128 --bursts 10 --out speech_calls.json
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from bench.burst_cli import burst_main
from bench.loadgen.metrics import Stats

APP = "talker_call_burst"
KINDS = ("live", "speech", "speech-per-call")


def _caller_class():
    from ray import serve

    @serve.deployment(max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
    class Caller:
        """An ingress replica's Talker requests of one kind: its mailbox and `TalkerCalls`, as `TTSIngress` has them."""

        def __init__(self, talker, kind: str):
            from deployments import constants as C
            from deployments.ingress.talker_calls import TalkerCalls
            from deployments.text_mailbox import MailboxWriter, new_mailbox
            from deployments.transport import stage_handle

            self._writer = MailboxWriter(new_mailbox())
            self._talker, self._kind = talker, kind
            self._per_call = stage_handle(talker, "grpc").options(stream=True)
            self._calls = TalkerCalls(stage_handle(talker, "grpc"), self._writer.handle, C.TALKER_CALL_MAX_BATCH,
                                      C.TALKER_CALL_ADMISSION_WAIT_S, live=kind == "live",
                                      close_box=None if kind == "live" else self._writer.close)
            self._prompt = None
            self._calls_made = 0

        async def burst(self, n: int, tag: str) -> list[float]:
            """ms from each of `n` requests' start to its first item (live: `Admitted`; speech: its first chunk);
            then each is ended as a client that leaves ends it (its stream left, its box closed)."""
            from deployments.messages import GenerateOptions
            from stages.contract import SynthesisRequest
            from stages.prompts import build_live_prompt, build_prompt

            if self._prompt is None:
                info = await self._talker.info.remote()
                if self._kind == "live":
                    self._prompt = build_live_prompt(info.config, info.tokenizer, speaker="ryan", language="english")
                else:
                    self._prompt = build_prompt(info.config, info.tokenizer, "Hello there.", speaker="ryan",
                                                language="english")

            async def one(i: int):
                request = SynthesisRequest(f"{tag}-{i}", self._prompt, max_frames=100)
                options = GenerateOptions(first_chunk_frames=1)
                started = time.perf_counter()
                if self._kind == "speech-per-call":
                    self._calls_made += 1
                    stream = self._per_call.generate.remote(request, options)
                else:
                    stream = self._calls.open(request, options)
                    if self._kind == "speech":
                        await anext(stream)  # its `Admitted`
                await anext(stream)
                return (time.perf_counter() - started) * 1000, stream, request.request_id

            out = await asyncio.gather(*(one(i) for i in range(n)))
            for _, stream, request_id in out:
                stream.cancel()
                if self._kind == "live":
                    self._writer.close(request_id)  # a context closes its own box
            return [ms for ms, _, _ in out]

        async def calls(self) -> int:
            return self._calls.calls + self._calls_made

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
        print(f"{n} at once: to the first item p50 / p95 / max {st.p50:.1f} / {st.p95:.1f} / {st.max:.1f} ms, "
              f"{calls / bursts:.1f} Talker calls per burst, CPU ms per request {cpu_ms}", flush=True)
    return out


def run(sizes: list[int], bursts: int, idle_s: float = 5.0, kind: str = "live") -> dict[str, dict]:
    """Deploys the two on the connected Ray cluster, measures (the processes' idle CPU rate over `idle_s` first),
    and deletes the app."""
    from ray import serve

    from deployments.builder import build_talker_deployment
    from deployments.config import StreamingConfig, TalkerDeploymentConfig

    talker = build_talker_deployment(TalkerDeploymentConfig(
        name="burst", model=None, device="cpu", cpu_threads=1, engine_cls="tests.fake_engine:FakeTalkerEngine",
        engine_kwargs={"max_num_seqs": 1024, "max_seq_len": 512},
        deployment_config={"ray_actor_options": {"num_cpus": 0}}), StreamingConfig())
    serve.run(_caller_class().bind(talker, kind), name=APP, route_prefix=None)
    try:
        return asyncio.run(_drive(sizes, bursts, idle_s))
    finally:
        serve.delete(APP)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")  # before Serve is imported: the fastest recipe's
    return burst_main(argv, __doc__, run, "1,32,128", "requests starting at once", 10, kinds=KINDS)


if __name__ == "__main__":
    raise SystemExit(main())
