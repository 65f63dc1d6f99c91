"""The checkpoint's Qwen2 byte-level BPE as a `tokenizers.Tokenizer`, built as transformers builds it.

Qwen3-TTS checkpoints hold `vocab.json` + `merges.txt` + `tokenizer_config.json` (and may hold a
`tokenizer.json`). transformers' `Qwen2Tokenizer` turns them into a `tokenizers` pipeline (NFC, Qwen2's
split regex, byte-level, BPE without unk) and registers `added_tokens_decoder` on top; this module builds
the same pipeline with the `tokenizers` library alone, so that a CPU ingress tokenizes without importing
`transformers` (tests/stages/test_text_tokenizer.py checks the ids against `Qwen2TokenizerFast`).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def load_qwen2_tokenizer(checkpoint_dir: str | Path) -> Tokenizer:
    """`tokenizer.json` if the checkpoint has one, else vocab + merges; then the added tokens of
    `tokenizer_config.json` with exactly the ids it gives them (a ValueError otherwise)."""
    root = Path(checkpoint_dir)
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.exists() else {}
    if (root / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    else:
        vocab, merges = BPE.read_file(str(root / "vocab.json"), str(root / "merges.txt"))
        tokenizer = Tokenizer(BPE(vocab, merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=bool(config.get("add_prefix_space") or False), use_regex=False),
        ])
        tokenizer.decoder = decoders.ByteLevel()
    # in id order, each where the config puts it: `tokenizers` gives a new token the next free id
    for token_id, spec in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda item: int(item[0])):
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False), lstrip=spec.get("lstrip", False),
                           rstrip=spec.get("rstrip", False), normalized=spec.get("normalized", not spec.get("special")),
                           special=spec.get("special", False))
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(token.content) != int(token_id):
            raise ValueError(f"{config_path}: added token {token.content!r} has id {token_id}, but the vocabulary "
                             f"puts it at {tokenizer.token_to_id(token.content)}")
    tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return tokenizer
