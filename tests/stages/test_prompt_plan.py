"""Prompt plans (ids) embed on the device to the same rows as the reference `build_prefill`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.contract import VoiceClonePrompt
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.talker.layout import prefill_length, trailing_length
from stages.talker.prefill import build_prefill
from stages.talker.prompt_plan import embed_rows, embed_text_rows, frame_codes_of, plan_prompt


def _embed(model, plan):
    def t(a):
        return torch.as_tensor(a)[None]

    x_vector = torch.zeros(1, model.talker.config.hidden_size)
    if plan.x_vector is not None:
        x_vector[0] = torch.as_tensor(plan.x_vector)
    rows = embed_rows(model.talker, t(plan.text_ids), t(plan.codec_ids), t(frame_codes_of(plan)),
                      t(plan.ref_frames >= 0), x_vector, torch.tensor([plan.x_vector_row]))
    return rows[0], embed_text_rows(model.talker, t(plan.trailing_ids))[0]


def _check(model, prompt):
    plan = plan_prompt(model.config, prompt)
    ref = build_prefill(model.talker, model.config, prompt)
    assert plan.length == prefill_length(prompt) == ref.prefill.shape[0]
    assert plan.trailing_length == trailing_length(prompt) == ref.trailing.shape[0]
    with torch.no_grad():
        rows, trailing = _embed(model, plan)
    # same math per row, other token grouping of the text projection: float rounding only
    torch.testing.assert_close(rows, ref.prefill, rtol=0, atol=1e-5)
    torch.testing.assert_close(trailing, ref.trailing, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def cv(tiny_custom_voice):
    return Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)


@pytest.mark.parametrize("kw", [
    dict(text="Hello there.", speaker="ryan", language="english"),
    dict(text="Short", speaker="eric", language="chinese", instruct="Whisper it."),
    dict(text="All at once, please.", speaker="vivian", language="auto", non_streaming_text=True),
])
def test_custom_voice_plans_embed_like_build_prefill(cv, kw):
    text = kw.pop("text")
    _check(cv, build_prompt(cv.config, cv.tokenizer, text, **kw))


def test_voice_design_plan(tiny_voice_design):
    model = Qwen3TTS.load(tiny_voice_design, dtype="float32", decoder=False)
    _check(model, build_prompt(model.config, model.tokenizer, "Designed voice.", instruct="A deep calm voice."))


@pytest.mark.parametrize("mode", ["x_vector", "icl_streaming", "icl_long_text", "icl_non_streaming"])
def test_base_plans(tiny_base, mode):
    model = Qwen3TTS.load(tiny_base, dtype="float32", decoder=False)
    rng = np.random.default_rng(0)
    x_vector = rng.standard_normal(model.config.talker.hidden_size).astype(np.float32)
    if mode == "x_vector":
        voice = VoiceClonePrompt(x_vector=x_vector)
    else:
        ref_codes = rng.integers(0, 2048, size=(6 if mode == "icl_long_text" else 30, 16))
        voice = VoiceClonePrompt(x_vector=x_vector, ref_codes=ref_codes,
                                 ref_text_ids=tuple(model.tokenizer.encode("the reference transcript")))
    text = "A target text long enough to outlast the reference." if mode == "icl_long_text" else "Target."
    prompt = build_prompt(model.config, model.tokenizer, text, language="english", voice=voice,
                          non_streaming_text=mode == "icl_non_streaming")
    _check(model, prompt)
