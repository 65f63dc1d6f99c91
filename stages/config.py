"""Typed model configs parsed from a Qwen3-TTS checkpoint's `config.json`.

Only the fields our code reads are kept. Defaults are the released values (the official config
classes' defaults match no release, so a missing key falls back to the real value, not theirs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.contract import SamplingParams, TaskType

_KIND_TO_TASK = {
    "custom_voice": TaskType.CUSTOM_VOICE,
    "voice_design": TaskType.VOICE_DESIGN,
    "base": TaskType.BASE,
}


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """One Qwen3-style decoder stack (q/k-norm, GQA, SwiGLU, plain RoPE)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768

    @classmethod
    def from_dict(cls, d: dict[str, Any], **defaults: Any) -> TransformerConfig:
        values = {**defaults, **{k: d[k] for k in cls.__dataclass_fields__ if k in d}}
        if values.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {values['hidden_act']!r} (only silu)")
        return cls(**values)


@dataclass(frozen=True, slots=True)
class CodePredictorConfig:
    """The multi-token predictor that fills codebooks 1..15 of each frame."""

    transformer: TransformerConfig
    vocab_size: int = 2048
    num_code_groups: int = 16

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodePredictorConfig:
        return cls(
            transformer=TransformerConfig.from_dict(
                d, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=65536,
            ),
            vocab_size=d.get("vocab_size", 2048),
            num_code_groups=d.get("num_code_groups", 16),
        )


@dataclass(frozen=True, slots=True)
class CodecIds:
    """Control ids of the talker's codec vocabulary (codebook 0 lives in 0..2047)."""

    pad: int = 2148
    bos: int = 2149
    eos: int = 2150
    think: int = 2154
    nothink: int = 2155
    think_bos: int = 2156
    think_eos: int = 2157


@dataclass(frozen=True, slots=True)
class TalkerConfig:
    transformer: TransformerConfig
    code_predictor: CodePredictorConfig
    vocab_size: int = 3072
    text_vocab_size: int = 151936
    text_hidden_size: int = 2048
    num_code_groups: int = 16
    codec: CodecIds = field(default_factory=CodecIds)
    languages: dict[str, int] = field(default_factory=dict)  # name -> codec id (dialects included)
    speakers: dict[str, int] = field(default_factory=dict)  # lower-case name -> codec id
    speaker_dialects: dict[str, str] = field(default_factory=dict)  # speaker -> dialect language name

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TalkerConfig:
        for key in ("spk_id", "codec_language_id"):
            if key in d and not isinstance(d[key], dict):
                raise ValueError(f"talker_config.{key} must be a mapping, got {type(d[key]).__name__}")
        return cls(
            transformer=TransformerConfig.from_dict(
                d, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128,
            ),
            code_predictor=CodePredictorConfig.from_dict(d.get("code_predictor_config", {})),
            vocab_size=d.get("vocab_size", 3072),
            text_vocab_size=d.get("text_vocab_size", 151936),
            text_hidden_size=d.get("text_hidden_size", 2048),
            num_code_groups=d.get("num_code_groups", 16),
            codec=CodecIds(
                pad=d.get("codec_pad_id", 2148), bos=d.get("codec_bos_id", 2149),
                eos=d.get("codec_eos_token_id", 2150), think=d.get("codec_think_id", 2154),
                nothink=d.get("codec_nothink_id", 2155), think_bos=d.get("codec_think_bos_id", 2156),
                think_eos=d.get("codec_think_eos_id", 2157),
            ),
            languages={k.lower(): int(v) for k, v in d.get("codec_language_id", {}).items()},
            speakers={k.lower(): int(v) for k, v in d.get("spk_id", {}).items()},
            speaker_dialects={k.lower(): v for k, v in d.get("spk_is_dialect", {}).items() if v},
        )

    @property
    def hidden_size(self) -> int:
        return self.transformer.hidden_size

    @property
    def codebook_size(self) -> int:
        """Codes of codebook 0 are 0..codebook_size-1; ids above are control tokens (suppressed)."""
        return self.code_predictor.vocab_size


@dataclass(frozen=True, slots=True)
class TextTokenIds:
    im_start: int = 151644
    im_end: int = 151645
    assistant: int = 77091
    newline: int = 198
    tts_pad: int = 151671
    tts_bos: int = 151672
    tts_eos: int = 151673


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The whole `config.json` of a Qwen3-TTS 12 Hz checkpoint."""

    talker: TalkerConfig
    model_size: str  # "0b6" | "1b7"
    model_kind: str  # "custom_voice" | "base" | "voice_design"
    text_ids: TextTokenIds = field(default_factory=TextTokenIds)
    speaker_encoder: dict[str, Any] | None = None  # raw `speaker_encoder_config` (Base only)
    tokenizer_type: str = "qwen3_tts_tokenizer_12hz"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if d.get("model_type") not in (None, "qwen3_tts"):
            raise ValueError(f"not a Qwen3-TTS config: model_type={d.get('model_type')!r}")
        kind = d.get("tts_model_type")
        if kind not in _KIND_TO_TASK:
            raise ValueError(f"config.json: tts_model_type must be one of {sorted(_KIND_TO_TASK)}, got {kind!r}")
        if d.get("tokenizer_type", "qwen3_tts_tokenizer_12hz") != "qwen3_tts_tokenizer_12hz":
            raise ValueError(f"only the 12 Hz models are supported, got tokenizer_type={d.get('tokenizer_type')!r}")
        return cls(
            talker=TalkerConfig.from_dict(d["talker_config"]),
            model_size=str(d.get("tts_model_size", "")),
            model_kind=kind,
            text_ids=TextTokenIds(
                im_start=d.get("im_start_token_id", 151644), im_end=d.get("im_end_token_id", 151645),
                assistant=d.get("assistant_token_id", 77091), tts_pad=d.get("tts_pad_token_id", 151671),
                tts_bos=d.get("tts_bos_token_id", 151672), tts_eos=d.get("tts_eos_token_id", 151673),
            ),
            speaker_encoder=d.get("speaker_encoder_config") if kind == "base" else None,
            tokenizer_type=d.get("tokenizer_type", "qwen3_tts_tokenizer_12hz"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @property
    def task(self) -> TaskType:
        return _KIND_TO_TASK[self.model_kind]

    @property
    def accepts_instruction(self) -> bool:
        """The official wrapper drops `instruct` for 0.6B CustomVoice; Base takes none."""
        if self.model_kind == "voice_design":
            return True
        return self.model_kind == "custom_voice" and self.model_size != "0b6"

    @property
    def public_languages(self) -> list[str]:
        """Languages a user may ask for: 'auto' plus every non-dialect language id."""
        return ["auto", *(name for name in self.talker.languages if "dialect" not in name)]


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """`generation_config.json`: the checkpoint's default sampling parameters and length limit."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 8192

    @classmethod
    def from_file(cls, path: str | Path) -> GenerationDefaults:
        p = Path(path)
        if not p.exists():
            return cls()
        d = json.loads(p.read_text(encoding="utf-8"))
        rename = {"subtalker_dosample": "subtalker_do_sample"}
        d = {rename.get(k, k): v for k, v in d.items()}
        known = {f for f in SamplingParams.__dataclass_fields__ if f not in ("min_frames", "suppress_eos")}
        return cls(sampling=SamplingParams(**{k: d[k] for k in known if k in d}),
                   max_new_tokens=int(d.get("max_new_tokens", 8192)))
