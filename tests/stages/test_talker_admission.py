"""The talker engine's admission: bursts of arrivals in prefills before one step, prefills bounded by padded positions
(`max_prefill_batch`, `max_prefill_tokens`), the admission lead, and the prefill graphs' buckets (CPU, fp32)."""

from __future__ import annotations

import asyncio

import pytest

from stages.contract import SamplingParams, SynthesisRequest
from stages.qwen3_tts import Qwen3TTS
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.prompt_plan import plan_prompt
from tests.stages.test_talker_engine import _engine, engine_test_prompts

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True)


@pytest.fixture(scope="module")
def prompts(model) -> list:
    return engine_test_prompts(model)  # test_talker_engine.py's five


@pytest.fixture(scope="module")
def model(tiny_custom_voice) -> Qwen3TTS:
    return Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)


def _queue_while_held(engine, requests):
    """Queue `requests` while the engine thread is held in a run_on_device call, so that one command drain
    takes them all (a burst of arrivals); -> their streams."""
    import threading

    release, held = threading.Event(), threading.Event()
    engine.run_on_device(lambda: held.set() or release.wait())
    held.wait()
    streams = [engine.add_request(r) for r in requests]
    release.set()
    return streams



def _burst(engine, requests) -> tuple[list[tuple[list[str], int]], list[list]]:
    """`requests` arriving at once (`_queue_while_held`), run to their ends: each admission's request ids with the
    steps read before it, and each request's chunks."""
    admissions = []
    engine.on_admit = lambda ids: admissions.append((ids, engine.stats().steps))

    async def main():
        return [[c async for c in s] for s in _queue_while_held(engine, requests)]
    return admissions, asyncio.run(main())


@pytest.mark.parametrize("per_step", [1, 4])
def test_a_burst_is_admitted_in_several_prefills_before_one_step(model, prompts, per_step):
    """8 requests arriving at once, 2 per prefill: with max_prefills_per_step 4 all four prefills run before
    the first step (no stream is playing yet); with 1, one prefill per step, as before."""
    engine = _engine(model, max_num_seqs=8, max_prefill_batch=2, max_prefills_per_step=per_step)
    try:
        admissions, chunks = _burst(engine, [SynthesisRequest(f"b{i}", prompts[i % 5], GREEDY, 6) for i in range(8)])
        stats = engine.stats()
    finally:
        engine.shutdown()
    steps_at_admission = [(len(ids), steps) for ids, steps in admissions]
    assert [n for n, _ in steps_at_admission] == [2, 2, 2, 2]
    steps = [s for _, s in steps_at_admission]
    # steps read so far at each admission: an iteration launches its step after its prefills and reads the one
    # before, so one prefill per iteration sees 0, 0, 1, 2 and all four prefills in the first iteration 0, 0, 0, 0
    assert steps == ([0, 0, 0, 0] if per_step == 4 else [0, 0, 1, 2])
    assert stats.prefills == 4 and stats.burst_prefills == (3 if per_step == 4 else 0)
    assert all(sum(c.num_new for c in cs) == 6 for cs in chunks)


def test_a_burst_is_prefilled_shortest_prompts_first(model, prompts):
    """A burst's requests are prefilled max_prefill_batch at a time by prompt length, not arrival, so each batch
    pads less: all before the same first step. One prefill per iteration (no burst) keeps arrival order."""
    length = {f"r{i}": plan_prompt(model.config, prompts[i]).length for i in range(5)}
    assert len(set(length.values())) > 2  # the fixture's prompts differ in length
    engine = _engine(model, max_num_seqs=8, max_prefill_batch=2, max_prefills_per_step=4)
    try:
        admissions, chunks = _burst(engine, [SynthesisRequest(f"r{i}", prompts[i], GREEDY, 3) for i in range(5)])
    finally:
        engine.shutdown()
    by_length = sorted(length, key=lambda rid: (length[rid], int(rid[1:])))  # a stable sort: ties keep arrival
    assert [ids for ids, _ in admissions] == [by_length[0:2], by_length[2:4], by_length[4:]]
    assert {steps for _, steps in admissions} == {0}
    assert all(sum(c.num_new for c in cs) == 3 for cs in chunks)


@pytest.mark.parametrize("tokens", [4096, 96])
def test_a_burst_is_prefilled_in_batches_within_max_prefill_tokens(model, prompts, tokens):
    """Prefills hold as many prompts as their padded positions allow (`max_prefill_tokens`): all five in one
    prefill when it is large, several prefills when small, each within it; every one before the first step."""
    length = {f"r{i}": plan_prompt(model.config, prompts[i]).length for i in range(5)}
    engine = _engine(model, max_num_seqs=8, max_prefill_batch=8, max_prefills_per_step=8, max_prefill_tokens=tokens)
    try:
        admissions, chunks = _burst(engine, [SynthesisRequest(f"r{i}", prompts[i], GREEDY, 3) for i in range(5)])
        fits = [engine.runner.prefill_fits(len(ids), max(length[r] for r in ids)) for ids, _ in admissions]
    finally:
        engine.shutdown()
    assert sorted(r for ids, _ in admissions for r in ids) == [f"r{i}" for i in range(5)]
    assert (len(admissions) == 1) if tokens == 4096 else (len(admissions) > 1)
    assert all(fits)
    assert {steps for _, steps in admissions} == {0}
    assert all(sum(c.num_new for c in cs) == 3 for cs in chunks)


def test_prefill_graphs_stay_within_max_prefill_tokens(model):
    """Graphs are captured, and prefills formed, only where batch bucket x width bucket <= max_prefill_tokens (one
    prompt at any width always): 64 prompts of up to 32 positions go in one prefill, of 33-64 positions 32."""
    engine = _engine(model, max_num_seqs=4, max_prefill_batch=64)
    try:
        runner = engine.runner
        assert runner.max_prefill_tokens == 2048
        keys = runner.prefill_keys()
        assert (64, 32) in keys and (32, 64) in keys and (16, 128) in keys and (1, 128) in keys
        assert (64, 64) not in keys and (32, 80) not in keys
        assert all(b * w <= 2048 or b == 1 for b, w in keys)
        assert runner.prefill_fits(64, 32) and not runner.prefill_fits(64, 33) and runner.prefill_fits(32, 64)
        assert runner.prefill_fits(1, 4000) and not runner.prefill_fits(2, 1100) and not runner.prefill_fits(65, 16)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("lead_s,together", [(1e9, False), (-1e9, True)])
def test_extra_prefills_wait_while_a_playing_stream_lacks_lead(model, prompts, lead_s, together):
    """A stream is playing (its first chunk handed out) when 4 requests arrive at once, 2 per prefill: with an
    admission lead it cannot have (1e9 s), one prefill per step; with any lead enough (-1e9 s), both prefills
    before the next step."""
    engine = _engine(model, max_num_seqs=8, max_prefill_batch=2, max_prefills_per_step=4, admission_lead_s=lead_s)
    admissions = []
    engine.on_admit = lambda ids: admissions.append((ids, engine.stats().steps))
    try:
        async def main():
            playing = engine.add_request(SynthesisRequest("playing", prompts[0], GREEDY, 60))
            first = await playing.__anext__()  # its first chunk was handed out: it plays from here on
            streams = _queue_while_held(engine, [SynthesisRequest(f"n{i}", prompts[i + 1], GREEDY, 4)
                                                 for i in range(4)])
            rest = [[c async for c in s] for s in streams]
            return first, rest, [c async for c in playing]
        first, rest, playing_rest = asyncio.run(main())
    finally:
        engine.shutdown()
    assert first.num_new > 0
    burst = [steps for ids, steps in admissions if ids[0].startswith("n")]
    assert len(burst) == 2
    assert (burst[0] == burst[1]) is together
    assert all(sum(c.num_new for c in cs) == 4 for cs in rest)
    assert first.num_new + sum(c.num_new for c in playing_rest) == 60


@pytest.mark.parametrize("max_prefill_batch,largest", [(16, 16), (24, 16), (32, 32), (64, 64)])
def test_prefill_graph_batches_reach_max_prefill_batch(model, max_prefill_batch, largest):
    """The prefill batches that get a CUDA graph (a batch between two of them pads up to the next) are the
    buckets up to `max_prefill_batch`: 32 and 64 are graphed when the engine may admit that many at once."""
    engine = _engine(model, max_num_seqs=4, max_prefill_batch=max_prefill_batch)
    try:
        buckets = engine.runner.prefill_batch_buckets
    finally:
        engine.shutdown()
    assert buckets[0] == 1 and buckets[-1] == largest and list(buckets) == sorted(buckets)


def test_prefill_pads_to_the_configured_widths(model):
    """A batch pads to the first graphed width that holds its longest prompt: with widths 64 and 80, a batch whose
    longest prompt has 70 positions runs at 80, not 128 (half its positions padding)."""
    engine = _engine(model, max_num_seqs=4, prefill_widths=[128, 64, 80, 16])  # as YAML gives them: a list
    try:
        runner = engine.runner
        assert engine.config.prefill_widths == (16, 64, 80, 128)
        assert runner.prefill_width_buckets == (16, 64, 80, 128)
        assert runner.prefill_bucket(16, 70) == (16, 80)
        assert runner.prefill_bucket(3, 81) == (4, 128)
        assert runner.prefill_bucket(1, 64) == (1, 64)
        assert runner.prefill_bucket(1, 129) is None  # longer than every width: eager
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="prefill_widths"):
        TalkerEngineConfig(prefill_widths=(0, 64))


def test_prefill_pads_to_the_configured_batches(model):
    """A prefill of n requests pads to the first configured batch size >= n: with 3, 5 and 6 graphed, a prefill of
    5 runs 5 rows, not the 8 of the default sizes."""
    engine = _engine(model, max_num_seqs=4, prefill_batches=[16, 1, 2, 3, 5, 6, 8, 12])
    try:
        runner = engine.runner
        assert engine.config.prefill_batches == (1, 2, 3, 5, 6, 8, 12, 16)
        assert runner.prefill_bucket(5, 60) == (5, 64)
        assert runner.prefill_bucket(4, 60) == (5, 64)
        assert runner.prefill_bucket(7, 60) == (8, 64)
        assert runner.prefill_bucket(13, 60) == (16, 64)
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="prefill_batches"):
        TalkerEngineConfig(prefill_batches=(0, 4))


def test_the_first_chunk_says_when_its_request_was_queued_and_prefilled(model, prompts):
    """Wall times on the first chunk with frames (the Server-Timing stages `talker_queue`, `talker_text`): queued
    when added, or for a live request when its first word became final; prefilled after; no later chunk has them."""
    import time

    from stages.prompts import build_live_prompt

    engine = _engine(model, max_num_seqs=4)
    try:
        async def main():
            added = time.time()
            chunks = [c async for c in engine.add_request(SynthesisRequest("s", prompts[0], GREEDY, 6))]
            live = engine.open_request(SynthesisRequest("l", build_live_prompt(model.config, model.tokenizer,
                                                                               speaker="ryan"), GREEDY, 4))
            engine.append_text("l", "Hello")  # a word that could still grow: not final yet
            await asyncio.sleep(0.05)
            final = time.time()
            engine.append_text("l", " there")  # "Hello" is final: the request is queued
            engine.end_text("l")
            return added, chunks, final, [c async for c in live]
        added, chunks, final, live_chunks = asyncio.run(main())
    finally:
        engine.shutdown()
    first = chunks[0].stamps
    assert added <= first["queued"] <= first["prefilled"] <= time.time()
    assert all(not c.stamps for c in chunks[1:])
    assert final <= live_chunks[0].stamps["queued"] <= live_chunks[0].stamps["prefilled"]
