"""The continuous-batching talker engine against the reference generator (CPU, fp32, eager path)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from stages.contract import FinishReason, InvalidRequestError, SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.reference import ReferenceGenerator
from stages.talker.engine import TalkerEngine, TalkerEngineConfig
from stages.talker.layout import prefill_length, trailing_length
from stages.talker.prefill import build_prefill

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True)
SAMPLED = SamplingParams(suppress_eos=True)  # official defaults: temperature 0.9, top-k 50, penalty 1.05


@pytest.fixture(scope="module")
def model(tiny_custom_voice) -> Qwen3TTS:
    return Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)


@pytest.fixture(scope="module")
def prompts(model):
    return engine_test_prompts(model)


def engine_test_prompts(model) -> list:
    """Five prompts of different lengths, speakers, languages and layouts (tests/stages/test_talker_admission.py too)."""
    def p(text, speaker, language, **kw):
        return build_prompt(model.config, model.tokenizer, text, speaker=speaker, language=language, **kw)

    return [
        p("Hello there.", "ryan", "english"),
        p("A much longer sentence with quite a few more tokens than the first one has.", "vivian", "auto",
          non_streaming_text=False),
        p("Short", "eric", "chinese", instruct="Whisper it."),
        p("Medium length text, with punctuation!", "aiden", "english", non_streaming_text=False),
        p("Another one.", "sohee", "korean"),
    ]


def _engine(model, **overrides) -> TalkerEngine:
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, **overrides))
    engine.start(log=lambda _m: None)
    return engine


async def _collect(engine, request, delay=0.0, abort_after=None, schedule=None):
    await asyncio.sleep(delay)
    stream = engine.add_request(request, schedule)
    blocks = []
    async for chunk in stream:
        blocks.append(chunk.codes[chunk.context:])
        if abort_after is not None and sum(len(b) for b in blocks) >= abort_after:
            await stream.aclose()
            break
    codes = np.concatenate(blocks) if blocks else np.zeros((0, 16), dtype=np.int64)
    return codes, stream.finish_reason


def test_prefill_length_matches_layout(model, prompts):
    for prompt in prompts:
        emb = build_prefill(model.talker, model.config, prompt)
        assert prefill_length(prompt) == emb.prefill.shape[0]
        assert trailing_length(prompt) == emb.trailing.shape[0]


@pytest.mark.parametrize("exact_prefill", [True, False], ids=["reference-embeddings", "staged-ids"])
def test_engine_equals_reference_with_joins_and_leaves(model, prompts, exact_prefill):
    """5 requests of different modes/lengths through 3 rows: they queue, join and leave mid-batch.

    Both admission paths: reference prompt embeddings (bit-exact by construction) and the staged-id path the
    GPU runs (same math, other text-projection grouping; on this CPU it gives the same greedy codes)."""
    lengths = [30, 12, 25, 40, 7]
    reference = [ReferenceGenerator(model).generate_codes(p, GREEDY, n) for p, n in zip(prompts, lengths, strict=False)]
    engine = _engine(model, max_num_seqs=3, kernels={"exact_prefill": exact_prefill})
    try:
        async def main():
            return await asyncio.gather(*[
                _collect(engine, SynthesisRequest(f"r{i}", prompts[i], GREEDY, lengths[i]), delay=0.02 * i)
                for i in range(len(prompts))
            ])
        results = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    for i, (codes, reason) in enumerate(results):
        assert reason is FinishReason.LENGTH
        np.testing.assert_array_equal(codes, reference[i], err_msg=f"request {i}")
    assert stats.running == 0 and stats.waiting == 0 and stats.frames == sum(lengths)
    assert 0 < stats.device_wait_seconds < stats.step_seconds  # the output reads are a part of the step time
    assert 0 <= stats.host_bound_steps <= stats.steps
    assert stats.admitted == 5 and 0 < stats.command_wait_seconds <= stats.admission_wait_seconds


def test_abort_frees_slot_and_leaves_others_undisturbed(model, prompts):
    """A running request aborted after its first frames ends with finish reason ABORTED; its row and KV are free
    for a third request while the survivor runs on, unchanged."""
    reference = ReferenceGenerator(model).generate_codes(prompts[0], GREEDY, 30)
    engine = _engine(model, max_num_seqs=2)
    try:
        async def victim():
            stream = engine.add_request(SynthesisRequest("victim", prompts[1], GREEDY, 200))
            frames = 0
            async for chunk in stream:
                frames += chunk.num_new
                if frames >= 5:
                    engine.abort("victim")
                    break
            frames += sum([c.num_new async for c in stream])  # the stream still ends, with its reason
            return frames, stream.finish_reason

        async def main():
            v = asyncio.create_task(victim())
            survivor = asyncio.create_task(_collect(engine, SynthesisRequest("survivor", prompts[0], GREEDY, 30)))
            v = await v
            # the freed slot is reused by a third request while the survivor is still running
            late = await _collect(engine, SynthesisRequest("late", prompts[0], GREEDY, 30))
            return v, await survivor, late
        (v_frames, v_reason), (s_codes, s_reason), (l_codes, _) = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert v_reason is FinishReason.ABORTED
    assert 5 <= v_frames < 200
    np.testing.assert_array_equal(s_codes, reference)
    np.testing.assert_array_equal(l_codes, reference)
    assert stats.running == 0 and stats.kv_reserved_tokens == 0


def test_seeded_sampling_independent_of_batch(model, prompts):
    """A seeded request gives the same frames alone and inside a full batch of other requests: the engine's
    stats show a step that computed all four rows (the crowd's three and it)."""
    engine = _engine(model, max_num_seqs=4)
    try:
        async def alone():
            return await _collect(engine, SynthesisRequest("a", prompts[3], SAMPLED, 25, seed=42))

        async def crowded():
            others = [_collect(engine, SynthesisRequest(f"o{i}", prompts[i % 3], SAMPLED, 20 + i, seed=i))
                      for i in range(3)]
            return (await asyncio.gather(_collect(engine, SynthesisRequest("b", prompts[3], SAMPLED, 25, seed=42)),
                                         *others))[0]
        a, _ = asyncio.run(alone())
        assert engine.stats().max_step_batch == 1
        b, _ = asyncio.run(crowded())
        crowded_batch = engine.stats().max_step_batch
        c, _ = asyncio.run(_collect_once(engine, SynthesisRequest("c", prompts[3], SAMPLED, 25, seed=43)))
    finally:
        engine.shutdown()
    assert crowded_batch == 4  # b shared its steps with the three others
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c), "a different seed should give different frames"
    # the sampled path really samples: not the greedy output
    greedy = ReferenceGenerator(model).generate_codes(prompts[3], GREEDY, 25)
    assert not np.array_equal(a, greedy)


async def _collect_once(engine, request):
    return await _collect(engine, request)


def test_seeded_engine_equals_seeded_reference(model, prompts):
    reference = ReferenceGenerator(model).generate_codes(prompts[2], SAMPLED, 20, seed=7)
    engine = _engine(model, max_num_seqs=2)
    try:
        codes, _ = asyncio.run(_collect_once(engine, SynthesisRequest("s", prompts[2], SAMPLED, 20, seed=7)))
    finally:
        engine.shutdown()
    np.testing.assert_array_equal(codes, reference)


def test_admission_queues_when_kv_is_short(model, prompts):
    """A KV pool of 3 blocks: each request reserves 2 (its own length), so four requests run one at a time."""
    engine = _engine(model, max_num_seqs=8, kv_cache_tokens=48, kernels={"kv_block_size": 16})
    running_at_admission = []
    engine.on_admit = lambda ids: running_at_admission.append(engine.scheduler.num_running)
    try:
        async def main():
            return await asyncio.gather(*[_collect(engine, SynthesisRequest(f"q{i}", prompts[i], GREEDY, 10))
                                          for i in range(4)])
        results = asyncio.run(main())
    finally:
        engine.shutdown()
    assert running_at_admission == [1, 1, 1, 1]
    assert all(len(codes) == 10 and reason is FinishReason.LENGTH for codes, reason in results)


def test_request_aborted_while_queued_costs_no_prefill(model, prompts):
    """One row: A runs, B waits; aborting B ends it ABORTED at once, without a prefill or a row."""
    engine = _engine(model, max_num_seqs=1)
    try:
        async def main():
            a = engine.add_request(SynthesisRequest("A", prompts[0], GREEDY, 40))
            first = await a.__anext__()  # A is running
            b = engine.add_request(SynthesisRequest("B", prompts[1], GREEDY, 40))
            engine.abort("B")
            b_chunks = [chunk async for chunk in b]
            a_frames = first.num_new + sum([chunk.num_new async for chunk in a])
            return b_chunks, b.finish_reason, a_frames, a.finish_reason
        b_chunks, b_reason, a_frames, a_reason = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert b_chunks == [] and b_reason is FinishReason.ABORTED
    assert a_frames == 40 and a_reason is FinishReason.LENGTH
    assert stats.prefills == 1 and stats.waiting == 0 and stats.running == 0


def test_too_long_request_is_rejected(model, prompts):
    engine = _engine(model, max_num_seqs=1)
    try:
        async def main():
            engine.add_request(SynthesisRequest("long", prompts[0], GREEDY, 10_000))
        with pytest.raises(InvalidRequestError, match="too long"):
            asyncio.run(main())
    finally:
        engine.shutdown()


def test_eos_finishes_request(tiny_custom_voice, prompts):
    """A codec head biased towards EOS: once `min_frames` lets it through, codebook 0 is EOS, and the request ends
    by EOS after exactly `min_frames` frames, with the reference generator's codes (random weights alone would
    rarely reach EOS within a test's frames)."""
    eos_model = Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)
    head = eos_model.talker.codec_head
    biased = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(head.weight)
        biased.bias.zero_()
        biased.bias[eos_model.talker.config.codec.eos] = 1e4
    eos_model.talker.codec_head = biased
    params = SamplingParams(do_sample=False, subtalker_do_sample=False, min_frames=7)
    reference = ReferenceGenerator(eos_model).generate_codes(prompts[0], params, 60)
    engine = _engine(eos_model, max_num_seqs=1)
    try:
        codes, reason = asyncio.run(_collect_once(engine, SynthesisRequest("e", prompts[0], params, 60)))
    finally:
        engine.shutdown()
    assert len(reference) == 7 and reason is FinishReason.EOS
    np.testing.assert_array_equal(codes, reference)


def test_run_on_device_runs_between_steps_and_propagates_errors(model, prompts):
    import threading

    engine = _engine(model, max_num_seqs=1)
    try:
        async def main():
            thread = await asyncio.wrap_future(engine.run_on_device(lambda: threading.current_thread().name))
            with pytest.raises(ZeroDivisionError):
                await asyncio.wrap_future(engine.run_on_device(lambda: 1 / 0))
            codes, _ = await _collect(engine, SynthesisRequest("after", prompts[0], GREEDY, 5))
            return thread, codes
        thread, codes = asyncio.run(main())
    finally:
        engine.shutdown()
    assert thread == "talker-engine"  # the engine's device thread, not the caller's
    assert len(codes) == 5  # the engine keeps serving after a failing call


def test_engine_cuts_chunks_by_the_schedule_with_left_context(model, prompts):
    """Chunks are cut in the engine: sizes follow the schedule, each carries the frames before it as context."""
    from stages.chunking import ChunkSchedule

    schedule = ChunkSchedule(first_chunk_frames=1, steady_chunk_frames=4, left_context_frames=3)
    engine = _engine(model, max_num_seqs=2)
    try:
        async def main():
            stream = engine.add_request(SynthesisRequest("chunks", prompts[0], GREEDY, 11), schedule)
            return [chunk async for chunk in stream], stream.finish_reason
        chunks, reason = asyncio.run(main())
    finally:
        engine.shutdown()
    reference = ReferenceGenerator(model).generate_codes(prompts[0], GREEDY, 11)
    assert [c.num_new for c in chunks] == [n for _, n in schedule.plan(11)]  # 1, 2, 4, 4, then the final 0
    assert [c.context for c in chunks[:-1]] == [ctx for ctx, _ in schedule.plan(11)][:-1]
    assert chunks[-1].final and chunks[-1].finish_reason is FinishReason.LENGTH and reason is FinishReason.LENGTH
    np.testing.assert_array_equal(np.concatenate([c.codes[c.context:] for c in chunks]), reference)
    for c in chunks[1:]:
        done = sum(x.num_new for x in chunks[:c.seq])
        np.testing.assert_array_equal(c.codes[:c.context], reference[done - c.context:done])


def test_runner_moves_several_rows_at_once_and_frees_a_range(model):
    """`move_rows` does a release's moves in one gather + scatter: every destination gets its source's small
    state and its first trailing_len text rows (as one move at a time would), rows that do not move keep theirs;
    `free_rows` points a range of rows' KV tables at the scratch block. (The engine runs no request meanwhile.)"""
    engine = _engine(model, max_num_seqs=8)
    try:
        runner = engine.runner
        tensors = runner._row_tensors()
        for t in tensors:  # distinct contents per row
            t.copy_(torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape).to(t.dtype))
        runner.trailing.normal_()
        before = [t.clone() for t in tensors]
        trailing = runner.trailing.clone()
        runner.move_rows([(6, 1, 3), (7, 4, 5), (5, 2, 0)])
        for t, b in zip(tensors, before, strict=True):
            for src, dst in ((6, 1), (7, 4), (5, 2)):
                assert torch.equal(t[dst], b[src])
            for row in (0, 3, 5, 6, 7):
                assert torch.equal(t[row], b[row])
        assert torch.equal(runner.trailing[1, :3], trailing[6, :3])
        assert torch.equal(runner.trailing[4, :5], trailing[7, :5])
        assert torch.equal(runner.trailing[0], trailing[0]) and torch.equal(runner.trailing[3], trailing[3])
        # only each request's own text rows move: past them, and for a request without text, nothing changes
        assert torch.equal(runner.trailing[1, 3:], trailing[1, 3:]) and torch.equal(runner.trailing[4, 5:], trailing[4, 5:])
        assert torch.equal(runner.trailing[2], trailing[2])
        for _ in range(12):  # more calls than the staging ring has buffers: each call's indices stay its own
            runner.move_rows([(6, 1, 2)])
        assert torch.equal(runner.trailing[1, :2], trailing[6, :2])
        kept = runner.kv.block_table[:5].clone()
        runner.free_rows(5, 8)
        assert (runner.kv.block_table[5:8] == runner.kv.scratch_block).all()
        assert torch.equal(runner.kv.block_table[:5], kept)
    finally:
        engine.shutdown()


def test_stacked_codec_embeddings_are_views_and_embed_frames_bit_identically(tiny_custom_voice):
    """Talker.stack_codec_embeddings (the compiled engine's one-gather frame embedding): the 16 codebook
    embeddings become rows of one table (views: the state dict and the memory unchanged) and embed_frame_codes
    gives the same bits as 16 lookups, stacked and summed."""
    talker = Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False).talker
    before = {k: v.clone() for k, v in talker.state_dict().items()}
    codes = torch.stack([torch.randint(0, 2048, (3, 5), generator=torch.Generator().manual_seed(q)) for q in range(16)], -1)
    want = talker.embed_frame_codes(codes)
    talker.stack_codec_embeddings()
    assert torch.equal(talker.embed_frame_codes(codes), want)
    after = talker.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    table = talker.codec_tables.untyped_storage().data_ptr()
    assert talker.model.codec_embedding.weight.untyped_storage().data_ptr() == table
    assert all(e.weight.untyped_storage().data_ptr() == table for e in talker.code_predictor.model.codec_embedding)


def test_projected_pass_inputs_are_the_projection_of_the_lookup_on_the_few_row_path_only(tiny_custom_voice):
    """CodePredictor.project_codec_embeddings (the compiled engine with gemv_rows): a few-row pass's input is one
    lookup in a precomputed table, the input projection of the codebook's embedding of that id; wider passes and an
    engine without the tables look up the talker-wide embedding as before."""
    from stages.layers import LayerKernels, attention_inputs, attention_output_and_mlp

    talker = Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False).talker
    cp = talker.code_predictor
    codes = torch.randint(0, 2048, (3,), generator=torch.Generator().manual_seed(1))
    plain = cp.pass_inputs(codes, 4)
    assert torch.equal(plain, cp.model.codec_embedding[4](codes)[:, None])  # no tables yet
    cp.project_codec_embeddings()
    assert len(cp.projected_embeddings) == 14  # the 15th codebook feeds the talker only
    assert torch.equal(cp.pass_inputs(codes, 4), plain)  # no GEMV path: the lookup
    cp.model.kernels = LayerKernels(pre=attention_inputs, post=attention_output_and_mlp, gemv_rows=4)
    cp.model.fuse_projections()
    try:
        projected = cp.pass_inputs(codes, 4)
        want = cp.small_to_mtp_projection(cp.model.codec_embedding[4](codes))[:, None]
        assert projected.shape == want.shape and torch.allclose(projected, want, atol=1e-6, rtol=0)
        wide = torch.randint(0, 2048, (5,))  # 5 rows > gemv_rows: the talker-wide lookup
        assert torch.equal(cp.pass_inputs(wide, 2), cp.model.codec_embedding[2](wide)[:, None])
    finally:
        cp.model.kernels = None


def test_kv_pool_sized_after_a_warm_up_serves_like_the_reference(model, prompts):
    """The CUDA start-up's order, on CPU: the runner starts with a one-block pool, warms up (the widest decode step
    and prefill, on scratch state), then gets its real pool before any request; requests then give the reference's
    codes."""
    from stages.talker import cuda_graphs
    from stages.talker.runner import TalkerRunner

    def factory(m, config, num_blocks):
        runner = TalkerRunner(m, config, 1)
        cuda_graphs.warm_up(runner, (1, 2))
        runner.resize_kv(num_blocks)
        assert runner.kv.num_blocks == num_blocks and (runner.kv.block_table == runner.kv.scratch_block).all()
        return runner

    reference = ReferenceGenerator(model).generate_codes(prompts[0], GREEDY, 12)
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, max_num_seqs=2), factory)
    engine.start(log=lambda _m: None)
    try:
        codes, reason = asyncio.run(_collect_once(engine, SynthesisRequest("r", prompts[0], GREEDY, 12)))
        stats = engine.stats()
    finally:
        engine.shutdown()
    np.testing.assert_array_equal(codes, reference)
    assert reason is FinishReason.LENGTH and stats.kv_total_tokens == 2 * 256


def test_kernel_options_come_from_a_dict_and_invalid_values_name_their_field():
    from stages.talker.engine_config import KernelOptions

    cfg = TalkerEngineConfig(kernels={"gemv_rows": 0, "batch_buckets": [4, 1, 2]})
    assert cfg.kernels == KernelOptions(gemv_rows=0, batch_buckets=(4, 1, 2))
    with pytest.raises(ValueError, match="unknown kernels option.*attention_kernal"):
        TalkerEngineConfig(kernels={"attention_kernal": True})
    with pytest.raises(ValueError, match="kernels.gemv_rows"):
        TalkerEngineConfig(kernels={"gemv_rows": 9})
    with pytest.raises(ValueError, match="max_seq_len"):
        TalkerEngineConfig(max_seq_len=4)
    with pytest.raises(TypeError):  # the developer switches live under `kernels` only
        TalkerEngineConfig(gemv_rows=4)
