"""Deterministic mode of the talker engine (CPU, fp32, tiny random checkpoint): a seeded request's codes are the
same alone and co-batched with 1, 7 and many others whose prefills arrive while it runs, greedy and sampled, and
every kernel shape its numbers come from is the fixed one (one decode bucket of max_num_seqs rows, prefills of one
prompt, text rows projected in fixed-width products), which is what makes the GPU's bf16 kernels batch-invariant
(tests/stages/gpu/test_seeded_determinism.py checks the codes there)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from stages.chunking import ChunkSchedule
from stages.contract import SamplingParams, SynthesisRequest
from stages.prompts import build_live_prompt, build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.talker import prompt_plan
from stages.talker import runner as runner_module
from stages.talker.engine import TalkerEngine, TalkerEngineConfig
from stages.talker.runner import TalkerRunner

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True)
SAMPLED = SamplingParams(suppress_eos=True)
ROWS = 16  # max_num_seqs: the one decode shape
FRAMES = 14
TEXTS = ["Hello there, how are you today?", "Short", "A much longer sentence with quite a few more tokens than that.",
         "Medium length text, with punctuation!", "Numbers 1 2 3.", "Another one here."]
SPEAKERS = ["ryan", "vivian", "eric", "aiden", "sohee"]


@pytest.fixture(scope="module")
def model(tiny_custom_voice) -> Qwen3TTS:
    return Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)


class ShapeRecordingRunner(TalkerRunner):
    """The real runner, recording the shapes it runs: decode batch buckets, prefill batch sizes."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_rows: list[int] = []
        self.prefill_sizes: list[int] = []

    def launch_step(self, b: int, attn_len: int) -> int:
        self.step_rows.append(b)
        return super().launch_step(b, attn_len)

    def admit(self, batch) -> None:
        self.prefill_sizes.append(len(batch))
        super().admit(batch)


@pytest.fixture(scope="module", params=[False, True], ids=["staged-ids", "reference-embeddings"])
def engine(model, request):
    engine = TalkerEngine(model, TalkerEngineConfig(max_num_seqs=ROWS, max_seq_len=256, deterministic=True,
                                                    kernels={"exact_prefill": request.param}),
                          runner_factory=ShapeRecordingRunner)
    engine.start(log=lambda _m: None)
    yield engine
    engine.shutdown()


def _prompt(model, i: int):
    return build_prompt(model.config, model.tokenizer, TEXTS[i % len(TEXTS)], speaker=SPEAKERS[i % len(SPEAKERS)],
                        language="english")


async def _run(engine, model, sampling, others: int) -> np.ndarray:
    """The seeded request's codes; `others` requests (their own seeds and lengths) are added once its first frame
    is out, so their prefills run between its steps, and more of them keep arriving while it runs."""
    target = engine.add_request(SynthesisRequest("target", _prompt(model, 0), sampling, FRAMES, seed=1234),
                                ChunkSchedule(first_chunk_frames=1))
    blocks, tasks = [], []

    async def other(i: int) -> None:
        stream = engine.add_request(SynthesisRequest(f"o{i}", _prompt(model, i + 1), SAMPLED, 4 + i % 9, seed=i))
        async for _ in stream:
            pass

    async for chunk in target:
        blocks.append(chunk.codes[chunk.context:])
        if len(blocks) <= 2:  # arrivals in two waves while it runs: prefills between its steps
            tasks += [asyncio.create_task(other(i)) for i in range(len(tasks), others * len(blocks) // 2)]
    await asyncio.gather(*tasks)
    return np.concatenate(blocks)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_seeded_codes_are_identical_alone_and_in_any_batch(engine, model, sampling):
    runner = engine.runner
    runner.step_rows.clear()
    runner.prefill_sizes.clear()
    alone = asyncio.run(_run(engine, model, sampling, 0))
    assert alone.shape == (FRAMES, 16)
    for others in (1, 7, 3 * ROWS):  # 3 x ROWS: the rows fill up and the rest queue
        assert np.array_equal(asyncio.run(_run(engine, model, sampling, others)), alone), f"with {others} others"
    # what makes it hold on a GPU: one decode shape whatever runs, and every prefill alone
    assert set(runner.step_rows) == {ROWS}
    assert set(runner.prefill_sizes) == {1}
    assert len(runner.prefill_sizes) == 4 + 1 + 7 + 3 * ROWS


def test_config_fixes_the_shapes_without_invariant_products_and_leaves_the_default_alone():
    asked = TalkerEngineConfig(max_num_seqs=48, max_seq_len=512, max_prefill_batch=16, deterministic=True)
    fixed = asked.for_determinism(invariant_products=False)  # CPU: BLAS kernels follow the shape
    assert fixed.kernels.batch_buckets == (48,) and fixed.kernels.length_buckets == (512,)
    assert fixed.max_prefill_batch == 1 and fixed.prefill_batches == (1,)
    default = TalkerEngineConfig(max_num_seqs=48)
    assert default.for_determinism(False) is default and default.for_determinism(True) is default
    assert not default.deterministic and default.max_prefill_batch == 64
    assert len(default.kernels.batch_buckets) > 1


def test_invariant_products_keep_batches_free_and_pin_the_row_dependent_kernels():
    """CUDA (stages/row_invariant_products.py): prefills batch and decode uses its buckets, from 2 rows (torch.compile's
    size-1 variant is another kernel); the few-row GEMV path and attention key splits are off."""
    free = TalkerEngineConfig(max_num_seqs=48, deterministic=True).for_determinism(invariant_products=True)
    assert free.max_prefill_batch == 64 and min(free.prefill_batches) == 2 and len(free.prefill_batches) > 1
    assert min(free.kernels.batch_buckets) == 2 and len(free.kernels.batch_buckets) > 1
    assert free.kernels.gemv_rows == 0 and not free.kernels.attention_splits
    one = TalkerEngineConfig(max_num_seqs=1, deterministic=True).for_determinism(invariant_products=True)
    assert min(one.kernels.batch_buckets) == 1 and min(one.prefill_batches) == 1  # one row: always alone


def test_live_text_rows_are_projected_in_fixed_width_products(model, monkeypatch):
    """A live request's text rows (projected in the prefill, or later as text arrives with other requests' text)
    always come from products of the same [1, width] shape; its codes equal the same text fed another way."""
    calls: list[tuple[tuple[int, ...], int]] = []  # (ids shape, fixed width) of each projection of text rows

    def recording(talker, ids, fixed_width=0):
        calls.append((tuple(ids.shape), fixed_width))
        return prompt_plan.embed_text_rows(talker, ids, fixed_width)

    monkeypatch.setattr(runner_module, "embed_text_rows", recording)
    engine = TalkerEngine(model, TalkerEngineConfig(max_num_seqs=4, max_seq_len=256, max_text_rows=64,
                                                    deterministic=True, kernels={"exact_prefill": False}))
    engine.start(log=lambda _m: None)
    text = "Hello there, this is live text that arrives in pieces."
    try:
        async def live(pieces: list[str], others: int) -> np.ndarray:
            prompt = build_live_prompt(model.config, model.tokenizer, speaker="ryan", language="english")
            stream = engine.open_request(SynthesisRequest("live", prompt, SAMPLED, 20, seed=7), text=pieces[0])
            side = [engine.open_request(SynthesisRequest(f"s{i}", prompt, SAMPLED, 60, seed=i), text="Other ")
                    for i in range(others)]
            for piece in pieces[1:]:
                await asyncio.wrap_future(engine.run_on_device(lambda: None))  # a loop iteration between pieces
                engine.append_text("live", piece)
                for i in range(others):
                    engine.append_text(f"s{i}", "more ")
            engine.end_text("live")
            for i in range(others):
                engine.end_text(f"s{i}")
            blocks = [c.codes[c.context:] async for c in stream]
            for s in side:
                async for _ in s:
                    pass
            return np.concatenate(blocks)

        whole = asyncio.run(live([text], 0))
        pieces = asyncio.run(live([text[i:i + 7] for i in range(0, len(text), 7)], 3))
    finally:
        engine.shutdown()
    assert np.array_equal(whole, pieces)
    # text arrived while the request ran (projections beyond the prefills; how many depends on how the loop's
    # iterations met the appends), and every projection had the one fixed width: min(256, max_text_rows)
    assert len(calls) > 2 and {w for _, w in calls} == {64}, calls


def test_fixed_width_projection_equals_the_plain_one(model, monkeypatch):
    """Chunks of exactly [1, width] rows (the last padded with NONE), the same values as one product (CPU)."""
    shapes = []
    project = model.talker.embed_text
    monkeypatch.setattr(model.talker, "embed_text", lambda ids: shapes.append(tuple(ids.shape)) or project(ids))
    ids = torch.randint(0, 100, (3, 40))
    ids[1, 30:] = prompt_plan.NONE
    plain = prompt_plan.embed_text_rows(model.talker, ids)
    fixed = prompt_plan.embed_text_rows(model.talker, ids, fixed_width=16)
    assert fixed.shape == plain.shape
    torch.testing.assert_close(fixed, plain)
    assert shapes[1:] == [(1, 16)] * 9  # the first: the plain product
