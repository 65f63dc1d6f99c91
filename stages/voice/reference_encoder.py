"""Reference audio -> 16-codebook codec codes: the encoder half of `transformers.MimiModel` (Qwen3-TTS-Tokenizer-12Hz)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from stages.voice.config import ReferenceEncoderConfig

if TYPE_CHECKING:  # imported where an encoder is built (Base checkpoints only): transformers takes ~10 s to import
    from transformers import MimiModel


def _encoder_parts(mimi: MimiModel) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
    """(SEANet encoder, encoder transformer, downsample conv, split RVQ) of a MimiModel of either layout."""
    if hasattr(mimi.encoder, "encoder_seanet"):  # transformers >= 5: the encoder half is a MimiEncoderModel
        enc = mimi.encoder
        return enc.encoder_seanet, enc.encoder_transformer, enc.downsample, mimi.quantizer
    return mimi.encoder, mimi.encoder_transformer, mimi.downsample, mimi.quantizer  # 4.x: flat attributes


def _drop_codebook_cache(module: ReferenceAudioEncoder, _incompatible_keys) -> None:
    module.reset_codebook_cache()


class ReferenceAudioEncoder(nn.Module):
    """Mimi SEANet -> causal transformer -> stride-2 downsample -> split RVQ, first `num_quantizers` codebooks.

    The library's submodules are held under the attribute names of the official checkpoint (transformers 4.57
    layout, decoder halves deleted as `Qwen3TTSTokenizerV2Encoder` does), so `state_dict()` keys equal the
    `encoder.*` tensors of speech_tokenizer/model.safetensors minus that prefix, under any transformers version
    (5.x renamed them to `encoder.encoder_seanet.*`, `encoder.encoder_transformer.*`, `encoder.downsample.*`).
    Build it on a real device, not `meta`: the conv stride/padding and RoPE buffers are non-persistent.
    """

    def __init__(self, config: ReferenceEncoderConfig):
        super().__init__()
        self.config = config
        from transformers import MimiModel

        mimi_config = config.mimi_config()
        if hasattr(mimi_config, "decoder_config"):
            mimi_config.decoder_config = None  # transformers >= 5 then builds no decoder at all
        mimi = MimiModel(mimi_config)
        self.encoder, self.encoder_transformer, self.downsample, self.quantizer = _encoder_parts(mimi)
        self.register_load_state_dict_post_hook(_drop_codebook_cache)  # a named function keeps it picklable

    def reset_codebook_cache(self) -> None:
        """Mimi caches embed_sum / cluster_usage in a plain attribute on first use; drop it when buffers change."""
        from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook

        for m in self.modules():
            if isinstance(m, MimiEuclideanCodebook):
                m._embed = None

    def _apply(self, fn, recurse=True):  # .to() / .cuda() / .half(): the cached codebooks would not follow
        self.reset_codebook_cache()
        return super()._apply(fn, recurse)

    def num_frames(self, num_samples: int) -> int:
        return math.ceil(num_samples / self.config.downsample_rate)

    @torch.inference_mode()
    def encode(self, wav: torch.Tensor) -> torch.LongTensor:  # [n] at 24 kHz -> [ceil(n / 1920), num_quantizers]
        """`Qwen3TTSTokenizerV2Model.encode` for one mono clip (its padding mask is all ones)."""
        if wav.dim() != 1 or wav.numel() == 0:
            raise ValueError(f"expected a non-empty mono waveform [n], got shape {tuple(wav.shape)}")
        p = next(self.parameters())
        x = wav.to(device=p.device, dtype=p.dtype)[None, None]  # [1, 1, n]
        h = self.encoder(x)  # [1, hidden, ~n / 960]
        h = self.encoder_transformer(h.transpose(1, 2))[0].transpose(1, 2)  # causal, full context
        latents = self.downsample(h)  # [1, hidden, ~n / 1920]
        # Residual quantization is sequential, so the first k codebooks of a 32-codebook pass equal a k pass.
        codes = self.quantizer.encode(latents, self.config.num_quantizers)  # [K, 1, frames]
        return codes[:, 0, : self.num_frames(wav.numel())].transpose(0, 1)  # [frames, K]


@torch.no_grad()
def randomize_codebooks_(
    encoder: ReferenceAudioEncoder, generator: torch.Generator, std: float = 1.0, layer_scale: float = 0.1
) -> None:
    """Random-checkpoint helper: make every Mimi codebook non-degenerate.

    Default init leaves `embed_sum` at zero (all 2048 codewords equal, so every frame encodes to code 0) and
    `cluster_usage` at one. Draws embed_sum ~ N(0, std^2) and cluster_usage ~ U(0.5, 1.5) (codeword = embed_sum /
    usage, so the division is exercised), sets `initialized` to 1, and sets the transformer LayerScale (default
    0.01) to `layer_scale` so that the attention/MLP branches matter numerically. Randomly initialized SEANets
    give latents far larger than N(0, 1) (std ~20 at the tiny test shapes); a `std` near the latents' scale spreads
    the codes, otherwise a few extreme codewords win every frame. Draws happen on `generator.device`.
    """
    from transformers.models.mimi.modeling_mimi import MimiEuclideanCodebook, MimiLayerScale

    for m in encoder.modules():
        if isinstance(m, MimiEuclideanCodebook):
            m.embed_sum.copy_(torch.randn(m.embed_sum.shape, generator=generator, device=generator.device) * std)
            m.cluster_usage.copy_(torch.rand(m.cluster_usage.shape, generator=generator, device=generator.device) + 0.5)
            m.initialized.fill_(1.0)
        elif isinstance(m, MimiLayerScale):
            m.scale.fill_(layer_scale)
    encoder.reset_codebook_cache()
