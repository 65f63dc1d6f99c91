"""Splitting a long text into pieces (deployments/ingress/text_split.py) and planning them as Talker requests
(deployments/ingress/long_text.py) against the tiny checkpoints' configs."""

from __future__ import annotations

import dataclasses
import re

import pytest

from deployments.config import TTSServingArgs
from deployments.ingress.long_text import PiecePlanner, estimated_frames, piece_seed
from deployments.ingress.request_builder import VoiceChoice
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.text_split import Boundary, split_text
from tests.conftest import tiny_model_info


def _bytes_budget(limit: int):
    """A piece may hold `limit` UTF-8 bytes (the byte-level test tokenizer's text positions)."""
    return lambda text: (len(text.encode()) / limit,)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text)


ENGLISH = ("It was a bright cold day in April, and the clocks were striking thirteen. Winston Smith, his chin nuzzled "
           "into his breast in an effort to escape the vile wind, slipped quickly through the glass doors.\n\n"
           "The hallway smelt of boiled cabbage and old rag mats! At one end of it a coloured poster, too large for "
           "indoor display, had been tacked to the wall. Was it? \"Yes,\" he said.")


def test_english_is_cut_at_paragraphs_then_sentences_and_never_inside_a_word():
    pieces = split_text(ENGLISH, _bytes_budget(160))
    assert len(pieces) > 2 and all(len(p.text.encode()) <= 160 for p in pieces)
    assert _words(" ".join(p.text for p in pieces)) == _words(ENGLISH)  # every word, whole, in order
    assert pieces[-1].boundary is Boundary.PARAGRAPH
    # the first paragraph's end is a piece's end: it is the strongest boundary in that piece's second half
    first_paragraph = ENGLISH.split("\n\n")[0]
    ends = [p.text for p in pieces if p.boundary is Boundary.PARAGRAPH]
    assert any(first_paragraph.endswith(e[-30:]) for e in ends), ends
    assert all(p.text[-1] in '.!?"' for p in pieces if p.boundary >= Boundary.SENTENCE)


def test_a_text_that_fits_is_one_piece():
    assert [p.text for p in split_text("Hello there.  How are you?", _bytes_budget(100))] == \
        ["Hello there. How are you?"]


def test_chinese_is_cut_at_cjk_sentence_and_clause_marks():
    text = ("今天天气很好。我们去公园散步，看到了很多花、草和树！你喜欢吗？"
            "第二段开始了；这是一个很长的句子，没有什么特别的意思。")
    pieces = split_text(text, _bytes_budget(45))  # 15 characters
    assert all(len(p.text.encode()) <= 45 for p in pieces)
    assert "".join(p.text for p in pieces) == text  # rejoined without spaces: nothing lost, nothing added
    assert all(p.text[-1] in "。！？；，、" for p in pieces)
    assert [p.boundary for p in pieces if p.text[-1] in "。！？"] == \
        [Boundary.SENTENCE] * (len([p for p in pieces if p.text[-1] in "。！？"]) - 1) + [Boundary.PARAGRAPH]


def test_mixed_scripts_keep_latin_words_whole():
    text = "Qwen3-TTS 是一个语音合成模型，它能说 English 和中文。It speaks both quite well, 真的很好！Really."
    pieces = split_text(text, _bytes_budget(30))
    assert all(len(p.text.encode()) <= 30 for p in pieces)
    joined = " ".join(p.text for p in pieces)
    for word in ("Qwen3-TTS", "English", "speaks", "Really."):
        assert any(word in p.text for p in pieces), (word, pieces)
    assert re.sub(r"\s", "", joined) == re.sub(r"\s", "", text)


def test_no_punctuation_is_cut_between_words_or_cjk_characters():
    latin = " ".join(f"word{i}" for i in range(200))
    pieces = split_text(latin, _bytes_budget(64))
    assert all(len(p.text.encode()) <= 64 for p in pieces) and " ".join(p.text for p in pieces) == latin
    assert all(p.boundary is Boundary.WORD for p in pieces[:-1])
    chinese = "没有标点的中文句子就这样一直写下去不停地写直到很长很长的时候才结束" * 3
    pieces = split_text(chinese, _bytes_budget(30))
    assert all(len(p.text.encode()) <= 30 for p in pieces) and "".join(p.text for p in pieces) == chinese


def test_one_enormous_sentence_is_cut_at_clauses_then_words_and_a_wordless_run_between_characters():
    sentence = ", ".join(f"and then the {i}th thing happened to the traveller" for i in range(300)) + "."
    pieces = split_text(sentence, _bytes_budget(400))
    assert len(pieces) > 10 and all(len(p.text.encode()) <= 400 for p in pieces)
    assert all(p.text.endswith(",") and p.boundary is Boundary.CLAUSE for p in pieces[:-1])
    assert _words(" ".join(p.text for p in pieces)) == _words(sentence)
    run = "a" * 1000  # no word is this long: it is cut between characters
    pieces = split_text(f"Before. {run} after.", _bytes_budget(300))
    assert all(len(p.text.encode()) <= 300 for p in pieces) and "".join(p.text for p in pieces).count("a") >= 1000


def test_a_hundred_thousand_characters_split_quickly_enough_for_a_thread():
    pieces = split_text(ENGLISH * 250, _bytes_budget(500))  # ~100,000 characters
    assert len(pieces) > 150 and all(len(p.text.encode()) <= 500 for p in pieces)


def test_piece_seeds_are_derived_repeatably_from_the_request_seed():
    seeds = [piece_seed(1234, k) for k in range(50)]
    assert seeds == [piece_seed(1234, k) for k in range(50)] and seeds[0] == 1234
    assert len(set(seeds)) == 50 and all(0 <= s < 2**63 for s in seeds)
    assert seeds != [piece_seed(1235, k) for k in range(50)]
    assert piece_seed(None, 3) is None


def test_cjk_text_is_estimated_slower_than_latin():
    assert estimated_frames("你好世界") == 12 and estimated_frames("abcd") == 4 and estimated_frames("1984") == 12


@pytest.fixture(scope="module")
def cv(tiny_custom_voice):
    return tiny_model_info("cv", tiny_custom_voice)


def _args(**long_form) -> TTSServingArgs:
    return TTSServingArgs.model_validate({"models": [{"name": "cv"}], "ingress": {"long_form": long_form}})


def test_a_long_input_is_planned_as_pieces_that_each_fit_with_the_same_voice_and_sampling(cv):
    args = _args(sentence_pause_s=0.2, paragraph_pause_s=0.9)
    cv = dataclasses.replace(cv, default_max_new_tokens=2048)  # the serving default: above what fits max_seq_len
    body = SpeechRequest(model="cv", input=ENGLISH * 3, voice="ryan", seed=7, temperature=0.8, instructions="Calm.")
    planner = PiecePlanner(body, cv, VoiceChoice(speaker="ryan"), None, args, "req")
    assert not planner.fits_one()
    pieces = planner.pieces()
    assert len(pieces) > 2
    assert [p.request.request_id for p in pieces] == [f"req.{k}" for k in range(len(pieces))]
    assert [p.request.seed for p in pieces] == [piece_seed(7, k) for k in range(len(pieces))]
    assert len({(p.request.prompt.speaker_id, p.request.prompt.instruct_ids, p.request.sampling) for p in pieces}) == 1
    for p in pieces:  # a piece's estimated speech (ASCII: a frame per byte-level token), doubled, fits its frames
        assert 2 * len(p.request.prompt.text_ids) <= p.request.max_frames
    assert pieces[-1].pause_s == 0 and {p.pause_s for p in pieces[:-1]} <= {0.0, 0.2, 0.9}
    assert 0.9 in {p.pause_s for p in pieces}  # the paragraph break is a boundary
    assert not any(p.client_capped for p in pieces)  # capped at what fits max_seq_len: stopping there is a cut


def test_a_cap_from_the_client_or_its_default_is_the_clients(cv):
    """max_new_tokens, its configured default (default_max_new_tokens, here 300 < what fits), suppress_eos."""
    for fields in ({"max_new_tokens": 50}, {}, {"suppress_eos": True}):
        body = SpeechRequest(model="cv", input=ENGLISH * 3, voice="ryan", **fields)
        pieces = PiecePlanner(body, cv, VoiceChoice(speaker="ryan"), None, _args(), "req").pieces()
        assert pieces and all(p.client_capped for p in pieces), fields


def test_a_short_input_is_one_request(cv):
    body = SpeechRequest(model="cv", input="Hello there.", voice="ryan")
    assert PiecePlanner(body, cv, VoiceChoice(speaker="ryan"), None, _args(), "req").fits_one()
