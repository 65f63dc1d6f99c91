"""ECAPA-TDNN speaker encoder: 128-bin log mel -> x-vector (module names mirror `speaker_encoder.*` in model.safetensors)."""

from __future__ import annotations

import math

import torch
from torch import nn

from stages.voice.config import SpeakerEncoderConfig
from stages.voice.mel import log_mel_spectrogram


def _conv(c_in: int, c_out: int, kernel_size: int = 1, dilation: int = 1) -> nn.Conv1d:
    # Every conv of the official encoder pads "same" with reflection (a no-op for kernel 1).
    return nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, padding="same", padding_mode="reflect")


class TimeDelayNetBlock(nn.Module):
    """Dilated conv + ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel_size: int, dilation: int):
        super().__init__()
        self.conv = _conv(c_in, c_out, kernel_size, dilation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, c_in, T] -> [B, c_out, T]
        return torch.relu(self.conv(x))


class Res2NetBlock(nn.Module):
    """Channel groups processed hierarchically: group i>0 gets TDNN(group_i + output_{i-1}); group 0 passes."""

    def __init__(self, channels: int, scale: int, kernel_size: int, dilation: int):
        super().__init__()
        self.scale = scale
        width = channels // scale
        self.blocks = nn.ModuleList(TimeDelayNetBlock(width, width, kernel_size, dilation) for _ in range(scale - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T]
        parts = torch.chunk(x, self.scale, dim=1)
        outs = [parts[0]]
        for i, block in enumerate(self.blocks, start=1):
            outs.append(block(parts[i] if i == 1 else parts[i] + outs[-1]))
        return torch.cat(outs, dim=1)


class SqueezeExcitationBlock(nn.Module):
    """Per-channel gate from the time-averaged features."""

    def __init__(self, channels: int, se_channels: int):
        super().__init__()
        self.conv1 = _conv(channels, se_channels)
        self.conv2 = _conv(se_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T]
        s = x.mean(dim=2, keepdim=True)  # [B, C, 1]
        return x * torch.sigmoid(self.conv2(torch.relu(self.conv1(s))))


class SqueezeExcitationRes2NetBlock(nn.Module):
    """TDNN(k1) -> Res2Net -> TDNN(k1) -> SE, plus the residual."""

    def __init__(self, c_in: int, c_out: int, scale: int, se_channels: int, kernel_size: int, dilation: int):
        super().__init__()
        self.tdnn1 = TimeDelayNetBlock(c_in, c_out, 1, 1)
        self.res2net_block = Res2NetBlock(c_out, scale, kernel_size, dilation)
        self.tdnn2 = TimeDelayNetBlock(c_out, c_out, 1, 1)
        self.se_block = SqueezeExcitationBlock(c_out, se_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, C, T]
        return self.se_block(self.tdnn2(self.res2net_block(self.tdnn1(x)))) + x


def _weighted_stats(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std over time under weights w that sum to 1: x [B, C, T], w [B, 1|C, T] -> 2 x [B, C]."""
    mean = (w * x).sum(2)
    std = torch.sqrt((w * (x - mean.unsqueeze(2)).pow(2)).sum(2).clamp(eps))
    return mean, std


class AttentiveStatisticsPooling(nn.Module):
    """Attention over time, conditioned on global mean/std; returns the attended mean and std."""

    def __init__(self, channels: int, attention_channels: int):
        super().__init__()
        self.tdnn = TimeDelayNetBlock(channels * 3, attention_channels, 1, 1)
        self.conv = _conv(attention_channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, T] -> [B, 2C]
        b, _, t = x.shape
        # Uniform weights 1/T rather than x.mean(): the official code (an all-ones length mask divided by its
        # sum) rounds this way, so the result matches it bit for bit.
        uniform = x.new_full((b, 1, t), 1.0 / t)
        mean, std = _weighted_stats(x, uniform)
        context = torch.cat([x, mean.unsqueeze(2).expand(-1, -1, t), std.unsqueeze(2).expand(-1, -1, t)], dim=1)
        attn = torch.softmax(self.conv(torch.tanh(self.tdnn(context))), dim=2)  # [B, C, T]
        mean, std = _weighted_stats(x, attn)
        return torch.cat([mean, std], dim=1)


class SpeakerEncoder(nn.Module):
    """ECAPA-TDNN (Desplanques et al. 2020) as configured by Qwen3-TTS Base; the x-vector is not normalized."""

    def __init__(self, config: SpeakerEncoderConfig):
        super().__init__()
        self.config = config
        ch, ks, dil = config.enc_channels, config.enc_kernel_sizes, config.enc_dilations
        self.blocks = nn.ModuleList([TimeDelayNetBlock(config.mel_dim, ch[0], ks[0], dil[0])])
        for i in range(1, len(ch) - 1):
            self.blocks.append(SqueezeExcitationRes2NetBlock(
                ch[i - 1], ch[i], config.enc_res2net_scale, config.enc_se_channels, ks[i], dil[i],
            ))
        self.mfa = TimeDelayNetBlock(ch[-1], ch[-1], ks[-1], dil[-1])  # multi-layer feature aggregation
        self.asp = AttentiveStatisticsPooling(ch[-1], config.enc_attention_channels)
        self.fc = _conv(ch[-1] * 2, config.enc_dim)

    def forward(self, mels: torch.Tensor) -> torch.Tensor:  # [B, T, mel_dim] -> [B, enc_dim]
        """Batch rows must have equal length: the official pooling has no padding mask."""
        x = self.blocks[0](mels.transpose(1, 2))  # [B, C0, T]
        feats = []
        for block in self.blocks[1:]:
            x = block(x)
            feats.append(x)
        x = self.mfa(torch.cat(feats, dim=1))  # [B, C_last, T]
        pooled = self.asp(x).unsqueeze(2)  # [B, 2 * C_last, 1]
        return self.fc(pooled).squeeze(2)

    @torch.inference_mode()
    def embed(self, wav: torch.Tensor) -> torch.Tensor:  # [n] float32 at 24 kHz -> [enc_dim]
        """`extract_speaker_embedding`: mel in float32 on the input's device, encoder in the module's dtype."""
        p = next(self.parameters())
        mels = log_mel_spectrogram(wav.to(device=p.device, dtype=torch.float32))  # [1, T, 128]
        return self(mels.to(p.dtype))[0]


@torch.no_grad()
def randomize_speaker_encoder_(encoder: SpeakerEncoder, generator: torch.Generator) -> None:
    """Random-checkpoint helper: redraw every weight and bias ~ U(+-1/sqrt(fan_in)) (PyTorch's conv default).

    Default init is not degenerate here; this only makes weights a function of `generator` alone, so a seed
    gives the same checkpoint regardless of what else consumed the global RNG.
    """
    for conv in (m for m in encoder.modules() if isinstance(m, nn.Conv1d)):
        bound = 1.0 / math.sqrt(conv.in_channels * conv.kernel_size[0])
        for p in (conv.weight, conv.bias):
            p.copy_(torch.rand(p.shape, generator=generator, device=generator.device) * (2 * bound) - bound)
