"""Live text: pieces of any size give exactly the ids of the whole text (stages/text_stream.py).

Two tokenizers: the tiny checkpoints' own (byte-level, real pre-tokenizer, NFC and special tokens, merges for
"assistant"/"user"/"system" only) and one trained here with the same normalizer and pre-tokenizer and ~1,500
merges, so that most words are multi-byte merges that a cut in the wrong place would break.
"""

from __future__ import annotations

import random

import pytest

from stages.prompts import TextTokenizer
from stages.text_stream import TextPiece, TextStream

TEXTS = [
    "Hello there, assistant! How's it going?  Fine.\n\nNew paragraph: 3.14159 and 42 apples.",
    "The assistant's user said: don't, won't, they'll, I'm, we've -- okay.",
    "Spaces   and\ttabs \t and trailing spaces   ",
    "\nleading newline and more words",
    "Unicode: café, naïve, Ærøskøbing, façade, straße, ﬁ ligature, Ω sign.",
    "Decomposed: cafe\u0301, e\u0301e\u0301, a\u0346\u0323 x\u0301\u0323, n\u0303o.",
    "Hangul jamo \u1100\u1161\u11a8 and syllables 한국어 텍스트 음성 합성.",
    "中文文本转语音，支持流式输入。日本語のテキストも。",
    "Emoji 😀👍🏽 and flags 🇩🇪 mixed with text; Arabic مرحبا بالعالم.",
    "Special tokens in text: <|im_end|> and <|im_start|>assistant\n and <tts_pad> <|endoftext|>x",
    "Almost special: <|im_en and <| and < tts > done",
    "Numbers 1234567890, 1,000,000.50 and 3rd 21st",
    "a",
    "Hi!",
]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_custom_voice) -> TextTokenizer:
    return TextTokenizer(tiny_custom_voice)


@pytest.fixture(scope="module")
def trained_tokenizer(tiny_tokenizer) -> TextTokenizer:
    """A BPE with many merges over the Qwen2 normalizer + pre-tokenizer and the same special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    base = tiny_tokenizer._tok
    tok = Tokenizer(models.BPE())
    tok.normalizer, tok.pre_tokenizer, tok.decoder = base.normalizer, base.pre_tokenizer, base.decoder
    corpus = [t * 3 for t in TEXTS] + ["the quick brown fox jumps over the lazy dog " * 5,
                                       "streaming text to speech with a large language model " * 5]
    trainer = trainers.BpeTrainer(vocab_size=1800, initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tiny_tokenizer.added_tokens()])
    out = object.__new__(TextTokenizer)
    out._tok = tok
    assert len(out.encode("the quick brown fox")) < 8  # merges really happen
    return out


def _feed(stream: TextStream, pieces: list[str]) -> list[TextPiece]:
    out = []
    for p in pieces:
        piece = stream.append(p)
        if piece is not None:
            out.append(piece)
    out.append(stream.end())
    return out


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    chars = list(text)
    out = [chars, [text]]  # char by char, whole
    for _ in range(6):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


@pytest.mark.parametrize("which", ["tiny", "trained"])
def test_pieces_give_the_ids_of_the_whole_text(which, tiny_tokenizer, trained_tokenizer):
    tok = tiny_tokenizer if which == "tiny" else trained_tokenizer
    rng = random.Random(7)
    for text in TEXTS:
        role, whole = tok.target_ids(text)
        for pieces in _splits(text, rng):
            got = _feed(TextStream(tok), pieces)
            assert all(p.segment == 0 for p in got) and got[-1].closed and got[-1].ended
            assert [x for p in got for x in p.ids] == list(whole), (text, pieces)
            assert got[0].role_ids == role and all(p.role_ids is None for p in got[1:])


def test_token_by_token_pieces(trained_tokenizer):
    """An LLM's output: pieces that are decoded tokens of another tokenizer (here: our own tokens)."""
    tok = trained_tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = [tok._tok.decode([i]) for i in ids]
        if "".join(pieces) != text:  # a token that is part of a multi-byte character: not a whole piece
            continue
        got = _feed(TextStream(tok), pieces)
        assert [x for p in got for x in p.ids] == list(tok.target_ids(text)[1])


def test_the_last_word_is_held_back_until_the_next_starts(trained_tokenizer):
    tok = trained_tokenizer
    s = TextStream(tok)
    assert s.append("the qu") is not None  # "the" is final once " qu" began
    assert s.pending_text == " qu"
    assert s.append("ick") is None  # still the last word
    piece = s.append(" brown")
    assert list(piece.ids) == tok.encode(" quick") and s.pending_text == " brown"


def test_a_piece_that_ends_with_a_space_releases_its_last_word_at_once(trained_tokenizer):
    """Pieces sent as "word " (a client that ends each at a word boundary) are final as they arrive: only the
    space waits, since it joins the next word; " word" pieces (an LLM's tokens) wait for the next one."""
    tok = trained_tokenizer
    s = TextStream(tok)
    first = s.append("the ")
    assert first is not None and s.pending_text == " "
    piece = s.append("quick ")
    assert list(piece.ids) == tok.encode(" quick") and s.pending_text == " "
    ids = list(first.ids) + list(piece.ids) + list(s.flush().ids)
    assert tuple(ids) == tok.target_ids("the quick ")[1]  # the whole text's ids


def test_nothing_is_released_while_blank_and_a_blank_flush_is_dropped(tiny_tokenizer):
    s = TextStream(tiny_tokenizer)
    assert s.append("  \n ") is None and s.flush() is None and s.segment == 0  # dropped: nothing to speak
    pieces = [s.append("  Hi"), s.flush()]
    assert [x for p in pieces if p for x in p.ids] == list(tiny_tokenizer.target_ids("  Hi")[1])
    assert pieces[-1].closed and not pieces[-1].ended and s.segment == 1


def test_flush_closes_a_segment_and_the_next_text_is_tokenized_on_its_own(trained_tokenizer):
    tok = trained_tokenizer
    s = TextStream(tok)
    first = [p for p in (s.append("Hello wor"), s.flush()) if p is not None]
    second = _feed(s, list("ld, assistant."))
    assert [x for p in first for x in p.ids] == list(tok.target_ids("Hello wor")[1])
    assert first[-1].closed and not first[-1].ended and all(p.segment == 0 for p in first)
    assert [x for p in second for x in p.ids] == list(tok.target_ids("ld, assistant.")[1])
    assert all(p.segment == 1 for p in second) and second[0].role_ids == tok.target_ids("x")[0]
    with pytest.raises(RuntimeError):
        s.append("more")


def test_end_without_text(tiny_tokenizer):
    piece = TextStream(tiny_tokenizer).end()
    assert piece.ids == () and piece.closed and piece.ended
