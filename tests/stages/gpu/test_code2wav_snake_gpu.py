"""The vocoder's SnakeBeta kernels (stages/code2wav/fast.py) on CUDA: their sine is the SFU's `sin.approx` after a
two-FMA reduction to [-pi, pi], so they are checked against float64 math over arguments far outside that range."""

from __future__ import annotations

import pytest
import torch

from stages.code2wav import fast
from stages.code2wav.layers import SnakeBeta

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _act(channels: int, gen: torch.Generator) -> SnakeBeta:
    act = SnakeBeta(channels).cuda()
    with torch.no_grad():  # log-scale parameters: alpha in ~[0.1, 20], 1 / beta in ~[0.05, 10]
        act.alpha.copy_(torch.empty(channels).uniform_(-2.3, 3.0, generator=gen))
        act.beta.copy_(torch.empty(channels).uniform_(-2.3, 3.0, generator=gen))
    return act


def _reference(x: torch.Tensor, act: SnakeBeta) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 SnakeBeta of the kernel's fp32 argument x * alpha, the allowed error): the sine's argument is the
    same fp32 product the kernel forms, so only the sine and the final sum can differ (SFU sine: ~1e-6 absolute,
    scaled by 2 sin / beta; the sum's fp32 rounding)."""
    alpha, inv_beta = (p[:, None] for p in fast._params(act))
    arg = (x.float() * alpha).double()
    ref = x.double() + inv_beta.double() * torch.sin(arg) ** 2
    return ref, 4e-6 * inv_beta.double() + 2e-7 * ref.abs()


@torch.no_grad()
def test_snake_sine_is_within_fp32_rounding_of_float64_over_wide_arguments():
    gen = torch.Generator().manual_seed(0)
    channels = 96
    act = _act(channels, gen)
    x = (torch.randn(2, channels, 4096, generator=gen) * 20).cuda()  # |alpha x| up to ~2,000
    got = fast.snake(x, act, left_pad=6, right_pad=0)[..., 6:]
    ref, allowed = _reference(x, act)
    err = (got.double() - ref).abs()
    assert (err <= allowed).all(), (err / allowed).max().item()
    assert fast.snake(x, act, left_pad=6)[..., :6].abs().max().item() == 0.0  # the left padding stays zeros


@torch.no_grad()
def test_residual_snake_sine_is_within_fp32_rounding_of_float64():
    gen = torch.Generator().manual_seed(1)
    channels = 192
    act = _act(channels, gen)
    x, h = ((torch.randn(1, channels, 1000, generator=gen) * 10).cuda() for _ in range(2))
    y, s = fast.residual_snake(x, h, None, None, act, left_pad=2, right_pad=1)
    assert torch.equal(y, x + h)
    ref, allowed = _reference(x + h, act)
    err = (s[..., 2:-1].double() - ref).abs()
    assert (err <= allowed).all(), (err / allowed).max().item()
