"""`TalkerServer.generate_live_many` (no Serve around it) on the real engine and a tiny checkpoint, its text from a
real `TextMailbox` on the test cluster: one call speaks a batch of live requests, each on its own."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from deployments.config import StreamingConfig, TalkerDeploymentConfig
from deployments.messages import GenerateOptions, LiveAdmitted
from deployments.text_mailbox import MailboxWriter, TextEvent, new_mailbox
from stages.contract import CodecChunk, FinishReason, InvalidRequestError, SamplingParams, SynthesisRequest
from stages.prompts import build_live_prompt

pytestmark = pytest.mark.serve

STREAMING = StreamingConfig(first_chunk_frames=2, steady_chunk_frames=5, left_context_frames=3)


@pytest.fixture
def talker(ray_cluster, tiny_custom_voice):
    """-> (a Talker server without Serve, not started yet; a mailbox actor on the test cluster)."""
    import ray

    from deployments.talker.server import TalkerServer

    config = TalkerDeploymentConfig(name="cv", model=str(tiny_custom_voice), device="cpu", cpu_threads=1,
                                    engine_kwargs={"max_num_seqs": 4, "max_seq_len": 128},
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
        "g0": LiveAdmitted, "g1": LiveAdmitted, "bad": InvalidRequestError, "gone": LiveAdmitted}
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


def test_the_burst_bench_sends_a_burst_in_few_calls(ray_cluster):
    """`python -m bench.live_call_burst`'s measurement on the test cluster: every request of a burst is timed to its
    admission, and a burst from one caller goes in one call."""
    from bench.live_call_burst import run

    out = run([1, 5], bursts=2, idle_s=0.5)
    assert out["1"]["n"] == 2 and out["5"]["n"] == 10
    assert 0 < out["5"]["p50"] <= out["5"]["max"]
    assert out["1"]["talker_calls_per_burst"] == 1 and out["5"]["talker_calls_per_burst"] == 1
