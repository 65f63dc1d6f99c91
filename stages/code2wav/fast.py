"""Fused CUDA kernels for the code2wav vocoder, switched on per decoder instance by the engine (serving path).

Eager SnakeBeta is five broadcast elementwise kernels with four temporaries, and every causal conv first
copies its input into a left-padded tensor; together they were ~60% of the decoder's GPU time at large
batch (H100, bf16; docs/code2wav.md). `enable_fast_kernels(decoder)` re-routes, on that instance only:
- every SnakeBeta to one Triton kernel (fp32 math, one read and one write),
- each ResidualUnit to snake -> conv (the snake kernel writes the conv's zero left padding itself) -> snake -> conv,
- the last SnakeBeta + 1-channel conv to the same padded snake + a conv padded to 16 output channels
  (cuDNN has no tensor-core kernel for 1 output channel; that conv alone was ~15% of the time).
Parameters and module names are untouched. The result equals the eager decoder up to rounding (the snake
math is done in fp32 and rounded once instead of after each step): use the eager module for bit parity.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from stages.code2wav.layers import CausalConv1d, ResidualUnit, SnakeBeta
from stages.code2wav.model import Code2WavDecoder

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_BLOCK = 1024


if triton is not None:

    @triton.jit
    def _snake_kernel(x_ptr, y_ptr, alpha_ptr, inv_beta_ptr, C, T, stride_xb, stride_xc, T_out, PAD,
                      BLOCK: tl.constexpr):
        row = tl.program_id(0)  # b * C + c
        b, c = row // C, row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # output position, [0, PAD + T)
        src = t - PAD
        inside = (src >= 0) & (src < T)
        x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + c * stride_xc + src, mask=inside, other=0.0).to(tl.float32)
        a = tl.load(alpha_ptr + c)
        ib = tl.load(inv_beta_ptr + c)
        s = tl.sin(x * a)
        y = tl.where(inside, x + ib * (s * s), 0.0)
        tl.store(y_ptr + row.to(tl.int64) * T_out + t, y.to(y_ptr.dtype.element_ty), mask=t < T_out)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def snake(x: torch.Tensor, act: SnakeBeta, left_pad: int = 0) -> torch.Tensor:  # [B, C, T] -> [B, C, pad + T]
    """SnakeBeta in one kernel; the output starts with `left_pad` zero columns (a causal conv's padding)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, C, T = x.shape
    alpha, inv_beta = _params(act)
    y = torch.empty(B, C, left_pad + T, dtype=x.dtype, device=x.device)
    grid = (B * C, triton.cdiv(left_pad + T, _BLOCK))
    _snake_kernel[grid](x, y, alpha, inv_beta, C, T, x.stride(0), x.stride(1), left_pad + T, left_pad, BLOCK=_BLOCK)
    return y


def _params(act: SnakeBeta) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 e^alpha and 1 / (e^beta + 1e-9), cached on the module (weights do not change while serving)."""
    cached = getattr(act, "_fast_params", None)
    if cached is None or cached[0].device != act.alpha.device:
        with torch.no_grad():
            alpha = torch.exp(act.alpha.float()).contiguous()
            inv_beta = (1.0 / (torch.exp(act.beta.float()) + 1e-9)).contiguous()
        cached = (alpha, inv_beta)
        act._fast_params = cached
    return cached


def _snake_forward(self: SnakeBeta, x: torch.Tensor) -> torch.Tensor:
    return snake(x, self)


def _residual_forward(self: ResidualUnit, x: torch.Tensor) -> torch.Tensor:
    h = self.conv1.conv(snake(x, self.act1, self.conv1.left_pad))
    h = snake(h, self.act2, self.conv2.left_pad)
    return x + self.conv2.conv(h)


def _padded_snake_forward(self: SnakeBeta, x: torch.Tensor) -> torch.Tensor:
    return snake(x, self, self._fast_left_pad)


def _narrow_conv_forward(self: CausalConv1d, x: torch.Tensor) -> torch.Tensor:  # x already left-padded
    w, b = self._fast_weight
    return F.conv1d(x, w, b)[:, : self.conv.out_channels]


def enable_fast_kernels(decoder: Code2WavDecoder) -> bool:
    """Switch this decoder instance to the fused kernels (CUDA + Triton only). Returns whether it did."""
    if not available(next(decoder.parameters()).device):
        return False
    for module in decoder.modules():
        if isinstance(module, ResidualUnit):
            module.forward = types.MethodType(_residual_forward, module)
        elif isinstance(module, SnakeBeta):
            module.forward = types.MethodType(_snake_forward, module)
    act, conv = decoder.decoder[-2], decoder.decoder[-1]
    if isinstance(act, SnakeBeta) and isinstance(conv, CausalConv1d) and conv.conv.out_channels < 16:
        w, b = conv.conv.weight, conv.conv.bias
        with torch.no_grad():
            wide = torch.zeros(16, *w.shape[1:], dtype=w.dtype, device=w.device)
            wide[: w.shape[0]] = w
            bias = None
            if b is not None:
                bias = torch.zeros(16, dtype=b.dtype, device=b.device)
                bias[: b.shape[0]] = b
        conv._fast_weight = (wide, bias)
        act._fast_left_pad = conv.left_pad
        act.forward = types.MethodType(_padded_snake_forward, act)
        conv.forward = types.MethodType(_narrow_conv_forward, conv)
    decoder._fast_kernels = True
    return True


def disable_fast_kernels(decoder: Code2WavDecoder) -> None:
    """Back to the eager modules (bit-exact with the official decoder)."""
    for module in decoder.modules():
        if "forward" in module.__dict__:
            del module.forward
    decoder._fast_kernels = False
