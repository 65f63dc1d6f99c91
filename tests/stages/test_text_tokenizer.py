"""`TextTokenizer` (the `tokenizers` library alone) gives the ids transformers' `Qwen2TokenizerFast` gives.

The tiny checkpoints' vocabulary is bytes plus the merges of three words, so pre-tokenization barely shows
in it; the `merged` variant adds merges learnt across every boundary of the test strings (digits, spaces,
punctuation, scripts), which only a pre-tokenizer that splits exactly as Qwen2's keeps apart.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest

from stages.prompts import TextTokenizer

TEXTS = [
    "",
    "Hello, world!",
    "Hi",
    "It's 2026-11-22; the price is $1,234.56 (approx.) or 3.14159e10 %.",
    "I'M HERE, YOU'RE late; we'll see. They've said: don't, can't, it'd, he'll.",
    "我们今天去公园散步吧。你好！天气怎么样？",
    "日本語のテキストと English mixed 한국어 텍스트 and Русский текст.",
    "Ça va? naïve café — “quotes” ‘single’ … e\u0301 (decomposed é) Å\u030a",
    "emoji 👍🏽 family 👨‍👩‍👧 flags 🇩🇪🇯🇵 ♪♫",
    "digits 0123456789 ٣٤٥ ２０２６ ⅷ ½ ¹²³",
    "line1\nline2\r\n\n  indented\ttab   trailing   ",
    "   ",
    "\n\n\n",
    "a  b   c    d\t\te",
    "<|im_start|>assistant\nHello there, how are you?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nSpeak slowly, with a warm voice.<|im_end|>\n",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n",
    "x<|im_end|>y<tts_pad>z<|endoftext|><think></think><|audio_pad|>",
    "<|im_start|<|im_start|>> <|im_end |> <im_start> |im_end|",
    "assistant assistants Assistant user users system systemic",
    "Fullwidth Ｆｕｌｌｗｉｄｔｈ ＡＢＣ and math ∑∫√ ≤≥ ±×÷",
    "tabs\tand\x0bvertical\x0cfeeds\u2028line\u2029para\u00a0nbsp\u200bzw",
    "'s 's's 'S 'Ll ''' \"double\" `back`",
    "url https://example.com/a?b=c&d=e#f and mail a.b@c.de",
    "!!!??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
]


def _merged_checkpoint(source: Path, out: Path, n_merges: int = 400) -> Path:
    """The tiny tokenizer plus merges learnt on the byte-level TEXTS without any pre-tokenization (so many
    cross word, digit and space boundaries), each new token taking the id of an `<|unused_*|>` filler."""
    from stages.random_checkpoint import _byte_alphabet

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "tokenizer_config.json", out / "tokenizer_config.json")
    vocab = json.loads((source / "vocab.json").read_text(encoding="utf-8"))
    merges = (source / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]
    free = sorted(i for token, i in vocab.items() if token.startswith("<|unused_"))
    alphabet = _byte_alphabet()
    specials = [spec["content"] for spec in json.loads(
        (source / "tokenizer_config.json").read_text(encoding="utf-8"))["added_tokens_decoder"].values()]
    split = re.compile("|".join(map(re.escape, specials)))  # no merge may spell a special token
    words = [[alphabet[b] for b in piece.encode("utf-8")] for text in TEXTS for piece in split.split(text)]
    for _ in range(n_merges):
        pairs = Counter(p for w in words for p in zip(w, w[1:], strict=False))
        if not pairs:
            break
        (a, b), _count = pairs.most_common(1)[0]
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in vocab:
            unused = next(t for t, i in vocab.items() if i == free[0])
            del vocab[unused]
            vocab[merged] = free.pop(0)
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i:i + 2] = [merged]
                i += 1
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_custom_voice, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("text_tokenizers")
    merged = _merged_checkpoint(tiny_custom_voice, root / "merged")
    # a non-special added token (normalized, as Qwen's <tool_call>-style entries may be) beside the special ones
    mixed = root / "mixed"
    shutil.copytree(merged, mixed)
    config = json.loads((mixed / "tokenizer_config.json").read_text(encoding="utf-8"))
    for spec in config["added_tokens_decoder"].values():
        if spec["content"] in ("<think>", "</think>"):
            spec.update(special=False, normalized=True)
    (mixed / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    # a checkpoint that also carries tokenizer.json (as saved by transformers)
    with_json = root / "with_tokenizer_json"
    shutil.copytree(merged, with_json)
    _reference(merged).backend_tokenizer.save(str(with_json / "tokenizer.json"))
    return {"tiny": tiny_custom_voice, "merged": merged, "mixed": mixed, "tokenizer_json": with_json}


def _reference(path: Path):
    from transformers import Qwen2TokenizerFast

    return Qwen2TokenizerFast.from_pretrained(str(path))


@pytest.mark.parametrize("variant", ["tiny", "merged", "mixed", "tokenizer_json"])
def test_ids_match_transformers(tokenizer_dirs, variant):
    path = tokenizer_dirs[variant]
    ours, reference = TextTokenizer(path), _reference(path)
    mismatches = [(text, ours.encode(text), list(reference(text, add_special_tokens=False)["input_ids"]))
                  for text in TEXTS]
    assert [m for m in mismatches if m[1] != m[2]] == []
    if variant == "merged":  # the merges are in use: many texts tokenize to fewer ids than bytes
        assert sum(len(ours.encode(t)) < len(t.encode("utf-8")) for t in TEXTS if t.strip()) >= len(TEXTS) // 2


def test_special_tokens_have_their_config_ids(tokenizer_dirs):
    tok = TextTokenizer(tokenizer_dirs["tiny"])
    assert tok.encode("<|endoftext|><|im_start|><|im_end|>") == [151643, 151644, 151645]
    assert tok.encode("<tts_pad><tts_text_bos><tts_text_eod>") == [151671, 151672, 151673]
    assert tok.target_ids("Hi")[0] == (151644, 77091, 198)


def test_pickled_tokenizer_gives_the_same_ids(tokenizer_dirs):
    tok = TextTokenizer(tokenizer_dirs["merged"])
    copy = pickle.loads(pickle.dumps(tok))
    assert [copy.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]


def test_misplaced_added_token_is_an_error(tokenizer_dirs, tmp_path):
    (tmp_path / "ckpt").mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(tokenizer_dirs["tiny"] / name, tmp_path / "ckpt" / name)
    config_path = tmp_path / "ckpt" / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"]["151700"] = config["added_tokens_decoder"].pop("151675")  # a hole before it
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match="has id 151700"):
        TextTokenizer(tmp_path / "ckpt")
