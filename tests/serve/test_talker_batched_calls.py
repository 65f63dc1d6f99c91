"""`TalkerServer.generate_many` and `generate_live_many` (no Serve around them) on the real engine and a tiny
checkpoint, the live text and the cancellations from a real `TextMailbox` on the test cluster: one call speaks a
batch of requests, each on its own."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from deployments.config import StreamingConfig, TalkerDeploymentConfig
from deployments.messages import Admitted, GenerateOptions, ReplicaFullError
from deployments.text_mailbox import MailboxWriter, TextEvent, new_mailbox
from stages.contract import (
    CodecChunk,
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    SynthesisRequest,
)
from stages.prompts import build_live_prompt, build_prompt

pytestmark = pytest.mark.serve

STREAMING = StreamingConfig(first_chunk_frames=2, steady_chunk_frames=5, left_context_frames=3)


@pytest.fixture
def talker(ray_cluster, tiny_custom_voice):
    """-> (a Talker server without Serve, not started yet; a mailbox actor on the test cluster)."""
    import ray

    from deployments.talker.server import TalkerServer

    config = TalkerDeploymentConfig(name="cv", model=str(tiny_custom_voice), device="cpu", cpu_threads=1,
                                    engine_kwargs={"max_num_seqs": 4, "max_seq_len": 1024},
                                    first_chunk_decode_max_running=0)
    server, box = TalkerServer.sync_init(config, STREAMING), new_mailbox()
    yield server, box
    server.__del__()
    ray.kill(box)


def _requests(server, names: list[str], frames: int) -> list[SynthesisRequest]:
    info = server._info
    prompt = build_live_prompt(info.config, info.tokenizer, speaker="vivian", language="english")
    return [SynthesisRequest(name, prompt, SamplingParams(suppress_eos=True), max_frames=frames, seed=i)
            for i, name in enumerate(names)]


def test_one_call_speaks_a_batch_of_live_requests_each_on_its_own(talker):
    """Every request's admission comes in the call's first message (a refused one's error instead, the others go
    on); each request's chunks follow in order to its final one; a request whose box the ingress closed is aborted
    alone; the call ends when the last request has."""
    server, box = talker

    async def run():
        await server.start()
        writer = MailboxWriter(box)
        good = _requests(server, ["g0", "g1"], frames=7)
        gone, = _requests(server, ["gone"], frames=7)
        bad = dataclasses.replace(good[0], request_id="bad",
                                  prompt=dataclasses.replace(good[0].prompt, text_ids=(5,)))  # text in its prompt
        call = server.generate_live_many([(r, GenerateOptions()) for r in (*good, bad, gone)], box)
        first = await anext(call)
        for request in good:
            await writer.put(request.request_id, [TextEvent("append", "Hello there."), TextEvent("end")])
        writer.close("gone")
        rest = [item async for message in call for item in message]
        return first, rest

    first, rest = asyncio.run(run())
    assert {item.request_id: type(item.item or item.error) for item in first} == {
        "g0": Admitted, "g1": Admitted, "bad": InvalidRequestError, "gone": Admitted}
    by_request: dict[str, list[CodecChunk]] = {}
    ended: list[str] = []
    for item in rest:
        assert item.error is None, item.error
        assert item.request_id not in ended, "an item after its request's end"
        if item.item is None:
            ended.append(item.request_id)
        else:
            by_request.setdefault(item.request_id, []).append(item.item)
    assert sorted(ended) == ["g0", "g1", "gone"]
    for name in ("g0", "g1"):
        chunks = by_request[name]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        assert sum(c.num_new for c in chunks) == 7
        assert chunks[-1].final and chunks[-1].finish_reason is FinishReason.LENGTH
        assert not any(c.final for c in chunks[:-1])
    assert "gone" not in by_request  # its box closed before any text: it ended without a frame


def test_one_call_speaks_a_batch_of_speech_requests_each_on_its_own(talker):
    """Speech requests (their text in the prompt) share one call: each is admitted and speaks to its final chunk; one
    whose box the ingress closed (its client left) is aborted alone, mid-stream; a request beyond the replica's
    `max_ongoing_requests` is refused as the replica being full (the ingress sends it again), the others go on;
    nothing is left open."""
    server, box = talker

    async def run():
        await server.start()
        info = server._info
        prompt = build_prompt(info.config, info.tokenizer, "Hello there.", speaker="vivian", language="english")
        requests = [SynthesisRequest(name, prompt, SamplingParams(suppress_eos=True), max_frames=frames, seed=i)
                    for i, (name, frames) in enumerate((("s0", 7), ("s1", 7), ("gone", 900), ("over", 7)))]
        server._max_ongoing_requests = 3  # as a deployment with max_ongoing_requests 3
        call = server.generate_many([(r, GenerateOptions()) for r in requests], box)
        items = []
        async for message in call:
            items += message
            if any(i.request_id == "gone" and isinstance(i.item, CodecChunk) for i in message):
                MailboxWriter(box).close("gone")  # its client left after its first audio
        return items

    items = asyncio.run(run())
    assert {i.request_id: type(i.item or i.error) for i in items if isinstance(i.item, Admitted) or i.error} == {
        "s0": Admitted, "s1": Admitted, "gone": Admitted, "over": ReplicaFullError}
    chunks: dict[str, list[CodecChunk]] = {}
    ended = [i.request_id for i in items if i.item is None and i.error is None]
    for i in items:
        if isinstance(i.item, CodecChunk):
            chunks.setdefault(i.request_id, []).append(i.item)
    assert sorted(ended) == ["gone", "s0", "s1"]
    for name in ("s0", "s1"):
        assert [c.seq for c in chunks[name]] == list(range(len(chunks[name])))
        assert sum(c.num_new for c in chunks[name]) == 7 and chunks[name][-1].final
    # aborted mid-stream (900 frames: longer than the abort's way through the mailbox on a loaded machine)
    assert 0 < sum(c.num_new for c in chunks["gone"]) < 900 and not chunks["gone"][-1].final
    assert server._open == {} and server._text_pumps == {}


def test_closing_the_call_aborts_every_request_it_still_runs(talker):
    server, box = talker

    async def run():
        await server.start()
        writer = MailboxWriter(box)
        requests = _requests(server, ["a", "b"], frames=100)
        call = server.generate_live_many([(r, GenerateOptions()) for r in requests], box)
        await anext(call)  # both admitted
        for request in requests:
            await writer.put(request.request_id, [TextEvent("append", "Hello there, how are you today?")])
        seen: set[str] = set()
        async for message in call:  # until both speak
            seen |= {item.request_id for item in message if isinstance(item.item, CodecChunk)}
            if seen == {"a", "b"}:
                break
        await call.aclose()
        # a device call queued after the aborts runs once they were handled (the engine's one FIFO queue)
        return await asyncio.wrap_future(server._engine.run_on_device(lambda: server._engine.stats().running))

    assert asyncio.run(run()) == 0
    assert server._open == {} and server._text_pumps == {}


@pytest.mark.parametrize("kind, calls_for_5", [("live", 1), ("speech", 1), ("speech-per-call", 5)])
def test_the_burst_bench_sends_a_burst_in_few_calls(ray_cluster, kind, calls_for_5):
    """`python -m bench.talker_call_burst`'s measurement on the test cluster: every request of a burst is timed to its
    first item back, and a burst from one caller goes in one call (one per request in the unbatched form)."""
    from bench.talker_call_burst import run

    out = run([1, 5], bursts=2, idle_s=0.5, kind=kind)
    assert out["1"]["n"] == 2 and out["5"]["n"] == 10
    assert 0 < out["5"]["p50"] <= out["5"]["max"]
    assert out["1"]["talker_calls_per_burst"] == 1 and out["5"]["talker_calls_per_burst"] == calls_for_5
