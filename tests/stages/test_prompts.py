"""Prompt validation and layouts: clear errors naming the problem, the official templates' ids."""

from __future__ import annotations

import numpy as np
import pytest

from stages.config import ModelConfig
from stages.contract import InvalidRequestError, VoiceClonePrompt
from stages.prompts import TextTokenizer, build_prompt


@pytest.fixture(scope="module")
def cv(tiny_custom_voice):
    return ModelConfig.from_file(tiny_custom_voice / "config.json"), TextTokenizer(tiny_custom_voice)


@pytest.fixture(scope="module")
def cv06(tiny_custom_voice_06):
    return ModelConfig.from_file(tiny_custom_voice_06 / "config.json"), TextTokenizer(tiny_custom_voice_06)


@pytest.fixture(scope="module")
def base(tiny_base):
    return ModelConfig.from_file(tiny_base / "config.json"), TextTokenizer(tiny_base)


XVEC = VoiceClonePrompt(x_vector=np.zeros(64, dtype=np.float32))


def test_template_ids(cv):
    cfg, tok = cv
    role, text = tok.target_ids("Hi")
    assert role == (151644, 77091, 198)
    assert text == tuple(tok.encode("Hi"))
    assert tok.instruct_ids("x")[:3] == (151644, 872, 198) and tok.instruct_ids("x")[-2:] == (151645, 198)


def test_language_and_dialect_rule(cv):
    cfg, tok = cv
    langs = cfg.talker.languages
    assert build_prompt(cfg, tok, "a", speaker="Ryan", language="English").language_id == langs["english"]
    assert build_prompt(cfg, tok, "a", speaker="ryan", language="auto").language_id is None
    # Eric speaks Sichuan dialect: chinese/auto become the dialect, other languages stay
    assert build_prompt(cfg, tok, "a", speaker="Eric", language="Chinese").language_id == langs["sichuan_dialect"]
    assert build_prompt(cfg, tok, "a", speaker="eric", language=None).language_id == langs["sichuan_dialect"]
    assert build_prompt(cfg, tok, "a", speaker="eric", language="english").language_id == langs["english"]


@pytest.mark.parametrize("kwargs,message", [
    (dict(speaker="nobody"), "unknown speaker 'nobody'"),
    (dict(speaker="ryan", language="klingon"), "unsupported language 'klingon'"),
    (dict(speaker="ryan", language="sichuan_dialect"), "unsupported language"),
    (dict(speaker=None), "CustomVoice needs a speaker"),
    (dict(speaker="ryan", task="Base"), "cannot do task_type Base"),
    (dict(speaker="ryan", task="Podcast"), "unknown task_type 'Podcast'"),
    (dict(speaker="ryan", voice=XVEC), "cannot clone a reference voice"),
])
def test_custom_voice_errors(cv, kwargs, message):
    cfg, tok = cv
    with pytest.raises(InvalidRequestError, match=message):
        build_prompt(cfg, tok, "Hello", **kwargs)


def test_empty_text_is_rejected(cv):
    cfg, tok = cv
    with pytest.raises(InvalidRequestError, match="empty"):
        build_prompt(cfg, tok, "   ", speaker="ryan")


def test_instruction_kept_on_17b_dropped_on_06b(cv, cv06):
    cfg, tok = cv
    assert build_prompt(cfg, tok, "a", speaker="ryan", instruct="Be happy").instruct_ids
    cfg06, tok06 = cv06
    assert build_prompt(cfg06, tok06, "a", speaker="ryan", instruct="Be happy").instruct_ids is None


def test_base_errors_and_defaults(base):
    cfg, tok = base
    with pytest.raises(InvalidRequestError, match="needs a reference voice"):
        build_prompt(cfg, tok, "Hello")
    icl_without_text = VoiceClonePrompt(x_vector=XVEC.x_vector, ref_codes=np.zeros((3, 16), dtype=np.int64))
    with pytest.raises(InvalidRequestError, match="reference transcript"):
        build_prompt(cfg, tok, "Hello", voice=icl_without_text)
    with pytest.raises(InvalidRequestError, match="no preset speakers"):
        build_prompt(cfg, tok, "Hello", speaker="ryan", voice=XVEC)
    with pytest.raises(InvalidRequestError, match="take no instructions"):
        build_prompt(cfg, tok, "Hello", voice=XVEC, instruct="whisper")
    prompt = build_prompt(cfg, tok, "Hello", voice=XVEC)
    assert prompt.non_streaming_text is False  # the official default of voice cloning
    assert prompt.speaker_id is None and prompt.voice is XVEC
