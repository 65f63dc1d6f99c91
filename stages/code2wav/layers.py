"""Convolutional building blocks of code2wav: causal (transposed) convs, SnakeBeta, ConvNeXt, vocoder blocks.

Every layer here is strictly causal along time (output sample t depends on inputs <= t only), which is
what makes right-padded batching and prefix decoding exact. Parameter names mirror the official
checkpoint (`conv.weight`, `alpha`, `gamma`, `block.N...`), so `decoder.*` tensors load with strict=True.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv1d(nn.Module):
    """Stride-1 Conv1d that pads (kernel_size - 1) * dilation zeros on the left only."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, dilation=dilation, groups=groups)
        self.left_pad = (kernel_size - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_in, T] -> [B, C_out, T]
        return self.conv(F.pad(x, (self.left_pad, 0)))


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d that upsamples T -> T * stride by dropping the (kernel - stride) trailing samples.

    Those trailing samples are the only ones that would need a *future* input to be complete.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.trim = kernel_size - stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C_in, T] -> [B, C_out, T * stride]
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim] if self.trim else y


class SnakeBeta(nn.Module):
    """Periodic activation x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel (log-scale params)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        # Same operation order as the official code: (1 / (beta + eps)) * sin^2, not a division.
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ConvNeXtBlock(nn.Module):
    """Residual ConvNeXt block: causal depthwise conv k7 -> LayerNorm -> MLP x4 (GELU) -> gamma scale."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size=7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        h = self.dwconv(x).transpose(1, 2)  # [B, T, C]: LayerNorm and Linear act on channels
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)


class ResidualUnit(nn.Module):
    """SnakeBeta -> causal dilated conv k7 -> SnakeBeta -> conv k1, plus the skip connection."""

    def __init__(self, dim: int, dilation: int):
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv1d(dim, dim, kernel_size=7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv1d(dim, dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T]
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class VocoderBlock(nn.Module):
    """One upsampling stage: SnakeBeta -> causal ConvTranspose (x rate, halves channels) -> 3 ResidualUnits.

    Kept as a flat `block` list (activation, upsampler, units with dilation 1/3/9) to match checkpoint names.
    """

    def __init__(self, in_dim: int, out_dim: int, rate: int):
        super().__init__()
        self.block = nn.ModuleList(
            [
                SnakeBeta(in_dim),
                CausalConvTranspose1d(in_dim, out_dim, kernel_size=2 * rate, stride=rate),
                *(ResidualUnit(out_dim, dilation) for dilation in (1, 3, 9)),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, in_dim, T] -> [B, out_dim, T * rate]
        for layer in self.block:
            x = layer(x)
        return x
