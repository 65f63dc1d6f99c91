"""DecoderConfig: the shapes of the code2wav decoder (`decoder_config` of `speech_tokenizer/config.json`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

ACTIVATIONS = ("silu", "gelu")


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    """Defaults are the released Qwen3-TTS-Tokenizer-12Hz values (shared by every 12 Hz model)."""

    codebook_size: int = 2048
    codebook_dim: int = 512  # RVQ output width; each codebook itself holds codebook_dim // 2 values
    latent_dim: int = 1024
    hidden_size: int = 512
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int = 64  # explicit: heads * head_dim (1024) != hidden_size (512)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int = 72  # keys per query, the query itself included
    layer_scale_initial_scale: float = 0.01
    decoder_dim: int = 1536
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)  # the SnakeBeta/ConvTranspose vocoder blocks
    upsampling_ratios: tuple[int, ...] = (2, 2)  # the ConvNeXt upsamplers right after the transformer
    num_quantizers: int = 16
    num_semantic_quantizers: int = 1
    max_position_embeddings: int = 8000
    attention_bias: bool = False
    hidden_act: str = "silu"
    attention_dropout: float = 0.0
    semantic_codebook_size: int = 4096  # present in the released config, unused by the decoder
    vector_quantization_hidden_dimension: int = 512  # idem

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not supported (one of {ACTIVATIONS})")
        if self.num_semantic_quantizers != 1:
            # The official decoder hard-codes one semantic codebook whatever the config says.
            raise ValueError(f"num_semantic_quantizers must be 1, got {self.num_semantic_quantizers}")
        if self.num_quantizers <= self.num_semantic_quantizers:
            raise ValueError("num_quantizers must exceed num_semantic_quantizers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.codebook_dim % 2 or self.decoder_dim % 2 ** len(self.upsample_rates):
            raise ValueError("codebook_dim must be even and decoder_dim divisible by 2**len(upsample_rates)")
        if self.sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")

    @property
    def samples_per_frame(self) -> int:
        """Output samples per code frame (1920 = 80 ms at 24 kHz for the released codec)."""
        return math.prod(self.upsample_rates) * math.prod(self.upsampling_ratios)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecoderConfig:
        """Build from the `decoder_config` dict of `speech_tokenizer/config.json`; unknown keys are ignored."""
        rope_scaling = d.get("rope_scaling")
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
            raise ValueError(f"only default RoPE is supported, got rope_scaling={rope_scaling}")
        names = {f.name for f in fields(cls)}
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names}
        return cls(**kwargs)
