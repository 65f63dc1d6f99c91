"""The load generator's worker processes (bench/loadgen/fanout.py) against a small aiohttp server in the test's
own event loop: requests are spread, timed on the parent's clock, and cancelled in the worker when the point ends."""

from __future__ import annotations

import asyncio
import random
import time

from aiohttp import web

from bench.loadgen.client import SpeechSettings
from bench.loadgen.fanout import ProcessPoolClient
from bench.loadgen.records import LoadPoint, RequestResult
from bench.loadgen.runner import run_point
from bench.loadgen.sentences import Sentence
from bench.loadgen.summary import summarize

FRAMES = 3
FRAME_BYTES = 1920 * 2


def texts(n: int) -> list[Sentence]:
    return [Sentence("en", f"sentence {i}") for i in range(n)]


async def start_server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/audio/speech", handler)
    runner = web.AppRunner(app, handler_cancellation=True)  # a client that goes away cancels its handler
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def test_workers_share_the_requests_and_report_them_on_the_parents_clock():
    bodies: list[dict] = []

    async def speech(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "audio/pcm"})
        await resp.prepare(request)
        for _ in range(FRAMES):
            await resp.write(b"\0" * FRAME_BYTES)
            await asyncio.sleep(0.005)
        await resp.write_eof()
        return resp

    async def main():
        runner, url = await start_server(speech)
        try:
            settings = SpeechSettings(max_new_tokens=FRAMES, fixed_length=True)
            async with ProcessPoolClient(url, settings, processes=2) as client:
                before = time.perf_counter()
                run = await run_point(client, LoadPoint("closed", 4, 12), texts(12), random.Random(0))
                after = time.perf_counter()
                return run, client.requests_per_worker, before, after
        finally:
            await runner.cleanup()

    run, per_worker, before, after = asyncio.run(main())
    assert all(r.ok for r in run.results), [(r.failure, r.error) for r in run.results]
    assert sorted(b["input"] for b in bodies) == sorted(f"sentence {i}" for i in range(12))
    assert sum(per_worker) == 12 and min(per_worker) >= 1  # both workers ran requests
    assert run.peak_inflight == 4
    for r in run.results:  # the worker's times are on the parent's clock: inside the point, in order
        assert 0 <= r.sent_s <= r.first_audio_s <= r.end_s <= after - before + 1e-3
        assert r.audio_bytes == FRAMES * FRAME_BYTES and len(r.arrival_s) >= 1
    assert run.loop_lag_s  # the parent's samples, and the workers' beside them
    assert summarize(run).ok == 12


def test_cancelled_requests_are_cancelled_in_the_workers():
    started = 0
    all_started = asyncio.Event()
    cancelled = asyncio.Event()
    cancelled_count = 0

    async def hangs(request: web.Request) -> web.StreamResponse:
        nonlocal started, cancelled_count
        resp = web.StreamResponse(headers={"content-type": "audio/pcm"})
        await resp.prepare(request)
        await resp.write(b"\0" * FRAME_BYTES)
        started += 1
        if started == 3:
            all_started.set()
        try:
            await asyncio.Event().wait()  # never ends by itself: only a cancelled request closes it
        except asyncio.CancelledError:
            cancelled_count += 1
            if cancelled_count == 3:
                cancelled.set()
            raise
        return resp

    async def main():
        runner, url = await start_server(hangs)
        try:
            async with ProcessPoolClient(url, SpeechSettings(), processes=2) as client:
                results = [RequestResult(index=i, text=f"sentence {i}", language="en") for i in range(3)]
                origin = time.perf_counter()
                requests = [asyncio.create_task(client.synthesize(r, origin)) for r in results]
                await all_started.wait()
                for request in requests:  # as a point's deadline does
                    request.cancel()
                await asyncio.gather(*requests, return_exceptions=True)
                inflight = client.inflight
                await asyncio.wait_for(cancelled.wait(), 60)  # each worker closed its connection
            return results, inflight
        finally:
            await runner.cleanup()

    results, inflight = asyncio.run(main())
    assert inflight == 0 and all(r.done and r.failure == "aborted" for r in results)


def test_a_worker_that_dies_fails_its_requests_instead_of_hanging():
    got_request = asyncio.Event()

    async def hangs(request: web.Request) -> web.StreamResponse:
        got_request.set()
        await asyncio.Event().wait()

    async def main():
        runner, url = await start_server(hangs)
        try:
            async with ProcessPoolClient(url, SpeechSettings(), processes=1) as client:
                r = RequestResult(index=0, text="x", language="en")
                request = asyncio.create_task(client.synthesize(r, time.perf_counter()))
                await got_request.wait()
                client._workers[0].process.kill()
                await asyncio.wait_for(request, 60)
                return r
        finally:
            await runner.cleanup()

    r = asyncio.run(main())
    assert r.done and r.failure == "worker_lost" and "exited" in r.error
