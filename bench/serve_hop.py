"""The floor of one hop between two deployments: a Serve handle call from one replica to another against a plain
Ray actor call between two actors, on an otherwise idle cluster, one call at a time.

The served first audio's `to_talker` stage (the ingress's Talker call -> `Talker.generate` running) and
`to_ingress` (the first chunk's way back) are such hops with a request and a chunk inside (docs/serving.md "Where
first audio goes"). This measures what Serve itself takes for them: forward = `remote()` in the caller until the
callee's method runs, back = the callee's first item until the caller has it (both `time.time()`, one machine).

    RAY_SERVE_THROUGHPUT_OPTIMIZED=1 python -m bench.serve_hop --calls 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import numpy as np
import ray
from ray import serve

# about what a CustomVoice SynthesisRequest carries: ~60 token ids and a few small arrays
PAYLOAD = {"text_ids": list(range(60)), "codes": np.zeros((1, 16), dtype=np.int64)}


def percentiles(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(1e3 * float(np.percentile(values, 50)), 3),
            "p95_ms": round(1e3 * float(np.percentile(values, 95)), 3)}


class Callee:
    async def stream(self, payload):
        yield time.time()

    async def unary(self, payload):
        return time.time()


async def hops(call, calls: int, gap_s: float) -> dict:
    """`call()` -> (sent, callee started, callee answered, caller received) for `calls` calls in a row."""
    forward, back = [], []
    for _ in range(calls):
        sent, started, received = await call()
        forward.append(started - sent)
        back.append(received - started)
        await asyncio.sleep(gap_s)
    return {"forward": percentiles(forward), "back": percentiles(back)}


class Caller:
    """Calls the callee one call at a time, through a Serve handle (`ServeCaller`) or a Ray actor handle
    (`RayCaller`): the two differ only in how a streaming call's first item is read."""

    def __init__(self, callee):
        self.callee = callee

    async def first_item(self) -> float:
        raise NotImplementedError

    async def run(self, calls: int, gap_s: float) -> dict:
        async def streamed():
            sent = time.time()
            started = await self.first_item()
            return sent, started, time.time()

        async def unary():
            sent = time.time()
            started = await self.callee.unary.remote(PAYLOAD)
            return sent, started, time.time()

        return {"streaming": await hops(streamed, calls, gap_s), "unary": await hops(unary, calls, gap_s)}


class ServeCaller(Caller):
    async def first_item(self) -> float:
        async for started in self.callee.options(stream=True).stream.remote(PAYLOAD):
            return started


class RayCaller(Caller):
    async def first_item(self) -> float:
        async for ref in self.callee.stream.options(num_returns="streaming").remote(PAYLOAD):
            return await ref


async def serve_hops(calls: int, gap_s: float) -> dict:
    app = serve.deployment(ServeCaller).bind(serve.deployment(Callee, max_ongoing_requests=1000).bind())
    serve.run(app, name="hop", route_prefix=None)
    try:
        return await serve.get_app_handle("hop").run.remote(calls, gap_s)
    finally:
        serve.shutdown()  # inside the loop the driver's handle is bound to


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300, help="calls per kind")
    ap.add_argument("--gap-s", type=float, default=0.005, help="pause between two calls")
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args()
    ray.init(log_to_driver=False)
    callee = ray.remote(Callee).remote()
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ray": ray.__version__, "cpus": os.cpu_count(),
        "throughput_optimized": os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0"),
        "ray_actor_call": ray.get(ray.remote(RayCaller).remote(callee).run.remote(args.calls, args.gap_s)),
        "serve_handle_call": asyncio.run(serve_hops(args.calls, args.gap_s)),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
