"""Typed config of a Qwen3-ForcedAligner checkpoint, parsed from its `config.json` (the official `qwen3_asr` layout).

The official loader reads `thinker_config.{audio_config, text_config, audio_token_id, classify_num}` and, at the top
level, `timestamp_token_id` and `timestamp_segment_time`; only the fields our model reads are kept. Defaults are the
released Qwen3-ForcedAligner-0.6B values (the official config classes' defaults are those of the ASR models).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.config import TransformerConfig

# Qwen2 vocabulary ids of the prompt's structural tokens (the tokenizer files map the strings to these)
AUDIO_START_TOKEN = "<|audio_start|>"
AUDIO_END_TOKEN = "<|audio_end|>"
AUDIO_PAD_TOKEN = "<|audio_pad|>"
TIMESTAMP_TOKEN = "<timestamp>"
PAD_TOKEN = "<|endoftext|>"


@dataclass(frozen=True, slots=True)
class AudioEncoderConfig:
    """The Whisper-style audio tower: 3 stride-2 convs per window of `2 * n_window` mel frames, then a transformer
    whose attention is blocked in windows of `n_window_infer` mel frames."""

    num_mel_bins: int = 128
    d_model: int = 1024
    encoder_layers: int = 24
    encoder_attention_heads: int = 16
    encoder_ffn_dim: int = 4096
    output_dim: int = 1024
    downsample_hidden_size: int = 480
    n_window: int = 50
    n_window_infer: int = 800
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioEncoderConfig:
        cfg = cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        if cfg.activation_function != "gelu":
            raise ValueError(f"unsupported audio activation_function {cfg.activation_function!r} (only gelu)")
        if cfg.d_model % cfg.encoder_attention_heads:
            raise ValueError("audio_config.d_model must be a multiple of encoder_attention_heads")
        if cfg.n_window != 50:
            raise ValueError("audio_config.n_window must be 50: the official processor hard-codes 100-frame windows")
        if cfg.n_window_infer % (2 * cfg.n_window):
            raise ValueError("audio_config.n_window_infer must be a multiple of 2 * n_window")
        return cfg

    @property
    def chunk_frames(self) -> int:
        """Mel frames per convolution window."""
        return 2 * self.n_window


@dataclass(frozen=True, slots=True)
class AlignerConfig:
    audio: AudioEncoderConfig
    text: TransformerConfig
    vocab_size: int = 152064
    classify_num: int = 5000
    audio_token_id: int = 151676
    timestamp_token_id: int = 151705
    timestamp_segment_time: float = 80.0  # milliseconds per class of the timestamp head

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AlignerConfig:
        thinker = d.get("thinker_config") or {}
        if "forced_aligner" not in str(thinker.get("model_type", "")):
            raise ValueError("config.json is not a forced aligner's: thinker_config.model_type must name "
                             f"'forced_aligner', got {thinker.get('model_type')!r}")
        text = thinker.get("text_config") or {}
        defaults = cls.__dataclass_fields__  # (a slots dataclass has no class attributes holding the defaults)
        rope = text.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(f"unsupported text rope_scaling {rope!r} (only the default rope type)")
        if text.get("attention_bias"):
            raise ValueError("unsupported text_config.attention_bias = true")
        text_cfg = TransformerConfig.from_dict(text, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                               num_attention_heads=16, num_key_value_heads=8, head_dim=128)
        return cls(
            audio=AudioEncoderConfig.from_dict(thinker.get("audio_config") or {}),
            text=text_cfg,
            vocab_size=int(text.get("vocab_size", defaults["vocab_size"].default)),
            classify_num=int(thinker.get("classify_num", defaults["classify_num"].default)),
            audio_token_id=int(thinker.get("audio_token_id", defaults["audio_token_id"].default)),
            timestamp_token_id=int(d.get("timestamp_token_id", defaults["timestamp_token_id"].default)),
            timestamp_segment_time=float(d.get("timestamp_segment_time", defaults["timestamp_segment_time"].default)),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> AlignerConfig:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
