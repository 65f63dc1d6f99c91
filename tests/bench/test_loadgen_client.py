"""The load generator's client against a small aiohttp server: each request says whether it opened a connection."""

from __future__ import annotations

import asyncio

from aiohttp import web

from bench.loadgen.client import SpeechClient, SpeechSettings
from bench.loadgen.records import LoadPoint, PointRun, RequestResult
from bench.loadgen.report import build_document, markdown
from bench.loadgen.runner import SweepOutcome
from bench.loadgen.summary import summarize
from tests.bench.test_loadgen_fanout import FRAME_BYTES, FRAMES, start_server


def test_each_request_says_whether_it_opened_a_connection_and_the_report_splits_client_side():
    async def speech(request: web.Request) -> web.StreamResponse:
        await request.json()
        resp = web.StreamResponse(headers={"content-type": "audio/pcm", "server-timing": "total;dur=1.0"})
        await resp.prepare(request)
        for _ in range(FRAMES):
            await resp.write(b"\0" * FRAME_BYTES)
        await resp.write_eof()
        return resp

    async def main() -> list[RequestResult]:
        runner, url = await start_server(speech)
        try:
            results = [RequestResult(index=i, text=f"t{i}", language="en") for i in range(5)]
            async with SpeechClient(url, SpeechSettings(max_new_tokens=FRAMES, fixed_length=True)) as client:
                await client.synthesize(results[0], 0.0)  # opens the session's first connection
                await client.synthesize(results[1], 0.0)  # the same one, kept alive
                # three at once: one may take the idle connection, the other two must open their own
                await asyncio.gather(*(client.synthesize(r, 0.0) for r in results[2:]))
            return results
        finally:
            await runner.cleanup()

    results = asyncio.run(main())
    assert all(r.ok for r in results), [(r.failure, r.error) for r in results]
    assert results[0].new_connection is True and results[0].connect_s is not None and results[0].connect_s >= 0
    assert results[1].new_connection is False and results[1].connect_s is None
    burst = [r.new_connection for r in results[2:]]
    assert burst.count(True) >= 2 and None not in burst

    s = summarize(PointRun(LoadPoint("closed", 3, 5), results, wall_s=1.0))
    new = sum(1 for r in results if r.new_connection)
    assert s.new_connections == new and s.connect_ms.n == new
    assert s.client_side_new_ms.n == new and s.client_side_kept_ms.n == len(results) - new
    md = markdown(build_document({"settings": {}, "sweep": {"mode": "closed"}}, SweepOutcome(
        [PointRun(LoadPoint("closed", 3, 5), results, wall_s=1.0)], [s], None)))
    assert "| level | ok on a new connection | connect |" in md and f"| 3 | {new} / 5 |" in md
