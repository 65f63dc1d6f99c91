"""Configs of the Base model's voice-clone front end: the ECAPA-TDNN speaker encoder and the Mimi reference encoder."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported where a Mimi encoder is built: importing it takes ~10 s on a GPU node
    from transformers import MimiConfig

# MimiConfig constructor arguments that shape the encoder; everything else in a saved `encoder_config`
# (architectures, model_type, dtype, transformers_version, ...) is bookkeeping and is dropped.
_MIMI_KEYS = frozenset((
    "sampling_rate", "frame_rate", "audio_channels", "hidden_size", "num_filters", "num_residual_layers",
    "upsampling_ratios", "kernel_size", "last_kernel_size", "residual_kernel_size", "dilation_growth_rate",
    "use_causal_conv", "pad_mode", "compress", "trim_right_ratio", "codebook_size", "codebook_dim",
    "num_quantizers", "use_conv_shortcut", "vector_quantization_hidden_dimension", "num_semantic_quantizers",
    "upsample_groups", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "hidden_act", "max_position_embeddings", "norm_eps", "rope_theta", "attention_dropout",
    "layer_scale_initial_scale", "attention_bias",
))

# The official package runs Mimi under transformers 4.57, whose eager/SDPA paths build a plain causal mask and
# ignore `sliding_window` (checked: window 8 and 100000 give identical outputs). transformers >= 5 honours it,
# which changes codes for references longer than 250 frames (10 s). A window longer than any input restores
# the official full-causal attention.
_NO_SLIDING_WINDOW = 1 << 30


@dataclass(frozen=True, slots=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` of config.json; defaults are `Qwen3TTSSpeakerEncoderConfig`'s (releases set
    only enc_dim: 1024 for 0.6B, 2048 for 1.7B, and sample_rate)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    def __post_init__(self) -> None:
        n = len(self.enc_channels)
        if n < 3 or len(self.enc_kernel_sizes) != n or len(self.enc_dilations) != n:
            raise ValueError("enc_channels, enc_kernel_sizes and enc_dilations need the same length (>= 3)")
        if any(c % self.enc_res2net_scale for c in self.enc_channels[1:-1]):
            raise ValueError(f"SE-Res2Net channels {self.enc_channels[1:-1]} must divide by {self.enc_res2net_scale}")
        if self.enc_channels[-1] != sum(self.enc_channels[1:-1]):
            # MFA concatenates the SE-Res2Net outputs, then a TDNN maps enc_channels[-1] -> enc_channels[-1].
            raise ValueError(f"enc_channels[-1] must equal sum(enc_channels[1:-1]), got {self.enc_channels}")
        if self.sample_rate != 24000:
            raise ValueError("the official mel front end is fixed to 24 kHz (extract_speaker_embedding asserts it)")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> SpeakerEncoderConfig:
        """From config.json's `speaker_encoder_config`; missing keys take the defaults, unknown keys are ignored."""
        d = d or {}
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for k in ("enc_channels", "enc_kernel_sizes", "enc_dilations"):
            if k in kw:
                kw[k] = tuple(int(v) for v in kw[k])
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class ReferenceEncoderConfig:
    """The encoder half of speech_tokenizer/config.json: Mimi config, codebooks kept, samples per code frame."""

    encoder: Mapping[str, Any]  # `encoder_config`: a MimiConfig dict
    num_quantizers: int = 16  # `encoder_valid_num_quantizers`: codebooks kept of Mimi's 32
    downsample_rate: int = 1920  # `encode_downsample_rate`: audio samples per code frame
    sample_rate: int = 24000  # `input_sample_rate`

    def __post_init__(self) -> None:
        object.__setattr__(self, "encoder", dict(self.encoder))  # a private copy (MappingProxyType cannot pickle)
        total = int(self.encoder.get("num_quantizers", 32))
        if not 1 <= self.num_quantizers <= total:
            raise ValueError(f"encoder_valid_num_quantizers={self.num_quantizers} not in [1, {total}]")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ReferenceEncoderConfig:
        """From the whole speech_tokenizer/config.json dict (the decoder half is ignored)."""
        return cls(
            encoder=d.get("encoder_config") or {},
            num_quantizers=int(d.get("encoder_valid_num_quantizers", 16)),
            downsample_rate=int(d.get("encode_downsample_rate", 1920)),
            sample_rate=int(d.get("input_sample_rate", 24000)),
        )

    def mimi_config(self) -> MimiConfig:
        """A `transformers.MimiConfig` that reproduces the official encoder (SDPA, full causal attention)."""
        from transformers import MimiConfig

        kw = {k: v for k, v in self.encoder.items() if k in _MIMI_KEYS}
        if "frame_rate" not in kw and self.encoder.get("_frame_rate") is not None:
            kw["frame_rate"] = self.encoder["_frame_rate"]  # the name 4.57's save_pretrained writes
        cfg = MimiConfig(**kw, sliding_window=_NO_SLIDING_WINDOW)
        cfg._attn_implementation = "sdpa"
        if cfg.sampling_rate != self.sample_rate:
            raise ValueError(f"Mimi sampling_rate {cfg.sampling_rate} != input_sample_rate {self.sample_rate}")
        return cfg
