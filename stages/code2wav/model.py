"""Code2WavDecoder: 16 codebooks x T frames -> 24 kHz waveform, numerically the official codec decoder.

Pipeline (names are the checkpoint's, under the `decoder.` prefix of `speech_tokenizer/model.safetensors`):
quantizer (RVQ dequant) -> pre_conv -> pre_transformer -> upsample (2x ConvNeXt x2) -> decoder (vocoder).
The whole stack is causal: decoding a prefix of frames gives a prefix of the samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from stages.code2wav.config import DecoderConfig
from stages.code2wav.layers import CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, SnakeBeta, VocoderBlock
from stages.code2wav.quantizer import SplitResidualDequantizer
from stages.code2wav.transformer import PreTransformer


class VocoderKernels(Protocol):
    """Another implementation of the vocoder stack (`decoder.decoder`) with the same parameters and result up to
    rounding: `stages/code2wav/fast.py`'s fused kernels for serving. None on a decoder = its eager modules.

    `carry(key, padded, rate)`, when given, fills each conv's causal history (the zero columns in front of its
    input) with a stream's carried state and returns the conv's input (`stateful.StatefulDecoder`); `rate` is
    the samples per frame entering the vocoder. Without it every stream starts from zeros."""

    def vocoder(self, layers: nn.ModuleList, h: torch.Tensor,
                carry: Callable[[str, torch.Tensor, int], torch.Tensor] | None = None,
                rate: int = 1) -> torch.Tensor: ...


class Code2WavDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.kernels: VocoderKernels | None = None  # eager modules (bit parity) unless the engine sets fused ones
        self.quantizer = SplitResidualDequantizer(
            cfg.num_quantizers, cfg.num_semantic_quantizers, cfg.codebook_size, cfg.codebook_dim
        )
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, kernel_size=3)
        self.pre_transformer = PreTransformer(cfg)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(cfg.latent_dim, cfg.latent_dim, r, r), ConvNeXtBlock(cfg.latent_dim)])
            for r in cfg.upsampling_ratios
        )
        # Channels halve at every vocoder block: decoder_dim -> decoder_dim / 2**len(upsample_rates).
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [
                CausalConv1d(cfg.latent_dim, cfg.decoder_dim, kernel_size=7),
                *(VocoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)),
                SnakeBeta(dims[-1]),
                CausalConv1d(dims[-1], 1, kernel_size=7),
            ]
        )

    @property
    def samples_per_frame(self) -> int:
        return self.cfg.samples_per_frame

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, K, T] int -> [B, 1, T * 1920] in [-1, 1]
        if codes.shape[1] != self.cfg.num_quantizers:
            raise ValueError(f"expected {self.cfg.num_quantizers} codebooks, got codes of shape {tuple(codes.shape)}")
        h = self.pre_conv(self.quantizer(codes))  # [B, latent_dim, T]
        h = self.pre_transformer(h.transpose(1, 2)).transpose(1, 2)  # attention runs over frames
        for upsampler, convnext in self.upsample:
            h = convnext(upsampler(h))  # [B, latent_dim, T * prod(upsampling_ratios)]
        if self.kernels is not None:
            h = self.kernels.vocoder(self.decoder, h)
        else:
            for layer in self.decoder:
                h = layer(h)
        return h.clamp(-1.0, 1.0)


@torch.no_grad()
def randomize_codebooks_(module: nn.Module, generator: torch.Generator | None = None) -> None:
    """Make a default-initialised decoder useful as a random test checkpoint (in place).

    Default init leaves every `embedding_sum` at zero, so the audio would not depend on the codes, and
    ConvNeXt `gamma` (1e-6) / LayerScale (0.01) make those branches numerically invisible. This sets
    codebook sums ~ N(0, 1), usage to 1, and all gammas / layer scales to 0.1. Works on any module
    whose names follow the checkpoint (ours or the official one). `generator` must live on the
    parameters' device.
    """
    for name, p in module.named_parameters():
        if name.endswith("embedding_sum"):
            p.normal_(0.0, 1.0, generator=generator)
        elif name.endswith("cluster_usage"):
            p.fill_(1.0)
        elif name.endswith((".gamma", "layer_scale.scale")):
            p.fill_(0.1)
