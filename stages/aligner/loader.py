"""Loading a Qwen3-ForcedAligner checkpoint in the official Hugging Face layout: `config.json` (model_type
`qwen3_asr`, a `qwen3_forced_aligner` thinker), `model.safetensors` (tensors under `thinker.`), and the Qwen2 tokenizer
files (`vocab.json`, `merges.txt`, `tokenizer_config.json`). A directory, or a Hugging Face id (`Org/Name`) found in
the local cache or downloaded (`stages.checkpoint.resolve_checkpoint`)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from stages.aligner.config import (
    AUDIO_END_TOKEN,
    AUDIO_PAD_TOKEN,
    AUDIO_START_TOKEN,
    PAD_TOKEN,
    TIMESTAMP_TOKEN,
    AlignerConfig,
)
from stages.aligner.model import ForcedAligner
from stages.checkpoint import CheckpointError, load_module_strict, resolve_checkpoint
from stages.text_tokenizer import load_qwen2_tokenizer

REQUIRED_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json")


def prompt_token_ids(tokenizer: Tokenizer, cfg: AlignerConfig) -> dict[str, int]:
    """The ids of the prompt's structural tokens, checked against the config where it names them."""
    ids = {}
    for token in (AUDIO_START_TOKEN, AUDIO_END_TOKEN, AUDIO_PAD_TOKEN, TIMESTAMP_TOKEN, PAD_TOKEN):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise CheckpointError(f"the aligner's tokenizer has no {token} token")
        ids[token] = token_id
    if ids[AUDIO_PAD_TOKEN] != cfg.audio_token_id or ids[TIMESTAMP_TOKEN] != cfg.timestamp_token_id:
        raise CheckpointError(
            f"tokenizer and config.json disagree: {AUDIO_PAD_TOKEN}={ids[AUDIO_PAD_TOKEN]} vs audio_token_id="
            f"{cfg.audio_token_id}, {TIMESTAMP_TOKEN}={ids[TIMESTAMP_TOKEN]} vs timestamp_token_id={cfg.timestamp_token_id}")
    return ids


def load_forced_aligner(path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                        ) -> tuple[ForcedAligner, Tokenizer]:
    root = resolve_checkpoint(path, REQUIRED_FILES)
    try:
        cfg = AlignerConfig.from_file(root / "config.json")
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{root / 'config.json'}: {e}") from e
    with torch.device("meta"):
        model = ForcedAligner(cfg)
    load_module_strict(model, root / "model.safetensors", "thinker.", device, dtype)
    tokenizer = load_qwen2_tokenizer(root)
    prompt_token_ids(tokenizer, cfg)
    return model, tokenizer
