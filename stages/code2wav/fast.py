"""Fused CUDA kernels for the code2wav vocoder, switched on per decoder instance by the engine (serving path).

Profiled on an H100 (bf16, batch 64 x 75 frames, docs/code2wav.md), the eager vocoder spent most of its
time outside the convolutions' arithmetic: SnakeBeta as five broadcast kernels with four temporaries,
the conv biases added by separate non-vectorized broadcast kernels, a left-padded copy of every causal
conv input, and one cuDNN fallback kernel (no tensor cores) for the dilation-9 conv at 384 channels.
`enable_fast_kernels(decoder)` gives that decoder instance `FusedVocoderKernels` (its `kernels` seam, as
the talker's layers take `LayerKernels`), which run each VocoderBlock and the final SnakeBeta + conv as:
- one Triton SnakeBeta kernel (fp32 math, one read, one write) that also adds the previous conv's bias
  and writes the next conv's zero padding, so no padded copy is made;
- dilated convs as 2-D convs over a (time / dilation, dilation) view (same arithmetic, tensor-core
  kernels), convs without bias;
- one Triton kernel for `x + bias + conv(h) + bias` at the end of each residual unit.
Parameters and modules are untouched. The output equals the eager decoder up to rounding (fp32 inside the
kernels, rounded once); use the eager modules (`disable_fast_kernels`) for bit parity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.code2wav.layers import CausalConv1d, ResidualUnit, SnakeBeta, VocoderBlock
from stages.code2wav.model import Code2WavDecoder

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_BLOCK = 1024
CONV2D_MIN_CHANNELS = 256  # dilated convs with at least this many input channels run as 2-D convs


if triton is not None:

    @triton.jit
    def _snake_kernel(x_ptr, y_ptr, alpha_ptr, inv_beta_ptr, bias_ptr, C, T, stride_xb, stride_xc, T_out, PAD,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # b * C + c
        b, c = row // C, row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # output position in [0, T_out)
        src = t - PAD
        inside = (src >= 0) & (src < T)
        x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + c * stride_xc + src, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + c).to(tl.float32)
        s = tl.sin(x * tl.load(alpha_ptr + c))
        y = tl.where(inside, x + tl.load(inv_beta_ptr + c) * (s * s), 0.0)
        tl.store(y_ptr + row.to(tl.int64) * T_out + t, y.to(y_ptr.dtype.element_ty), mask=t < T_out)

    @triton.jit
    def _residual_kernel(x_ptr, h_ptr, y_ptr, xb_ptr, hb_ptr, C, T, sxb, sxc, shb, shc,
                         HAS_XB: tl.constexpr, HAS_HB: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        b, c = row // C, row % C
        t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = t < T
        x = tl.load(x_ptr + b.to(tl.int64) * sxb + c * sxc + t, mask=m).to(tl.float32)
        h = tl.load(h_ptr + b.to(tl.int64) * shb + c * shc + t, mask=m).to(tl.float32)
        if HAS_XB:
            x = x + tl.load(xb_ptr + c).to(tl.float32)
        if HAS_HB:
            h = h + tl.load(hb_ptr + c).to(tl.float32)
        tl.store(y_ptr + row.to(tl.int64) * T + t, (x + h).to(y_ptr.dtype.element_ty), mask=m)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


def snake(x: torch.Tensor, act: SnakeBeta, left_pad: int = 0, right_pad: int = 0,
          bias: torch.Tensor | None = None) -> torch.Tensor:  # [B, C, T] -> [B, C, left + T + right]
    """SnakeBeta(x + bias) in one kernel, with `left_pad` / `right_pad` zero columns around the result."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, C, T = x.shape
    alpha, inv_beta = _params(act)
    t_out = left_pad + T + right_pad
    y = torch.empty(B, C, t_out, dtype=x.dtype, device=x.device)
    grid = (B * C, triton.cdiv(t_out, _BLOCK))
    _snake_kernel[grid](x, y, alpha, inv_beta, bias if bias is not None else alpha, C, T, x.stride(0), x.stride(1),
                        t_out, left_pad, HAS_BIAS=bias is not None, BLOCK=_BLOCK)
    return y


def residual(x: torch.Tensor, h: torch.Tensor, x_bias: torch.Tensor | None,
             h_bias: torch.Tensor | None) -> torch.Tensor:  # (x + x_bias) + (h + h_bias), [B, C, T]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if h.stride(-1) != 1:
        h = h.contiguous()
    B, C, T = x.shape
    y = torch.empty(B, C, T, dtype=x.dtype, device=x.device)
    dummy = x_bias if x_bias is not None else (h_bias if h_bias is not None else y)
    _residual_kernel[(B * C, triton.cdiv(T, _BLOCK))](
        x, h, y, x_bias if x_bias is not None else dummy, h_bias if h_bias is not None else dummy, C, T,
        x.stride(0), x.stride(1), h.stride(0), h.stride(1), HAS_XB=x_bias is not None, HAS_HB=h_bias is not None,
        BLOCK=_BLOCK)
    return y


def dilated_conv(h: torch.Tensor, weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """Conv1d (no padding, no bias) with `dilation`, as a 2-D conv over the (time / d, d) view of `h`.

    out[t] = sum_k w[k] h[t + k d]; with t = i d + j that is a conv along i for every column j. Needs
    `h.shape[-1] % dilation == 0` and contiguous `h`. Used from CONV2D_MIN_CHANNELS input channels up,
    where it was faster on the H100 (384 ch, d=9: 53.7 -> 3.2 ms; 768 ch: 2.9 -> 2.1 ms); below, cuDNN's
    dilated conv1d was faster (192 ch: 6.7 vs 7.3 ms; 96 ch: 7.3 vs 8.8 ms), batch 64 x 75 frames, bf16.
    """
    if dilation == 1 or h.shape[1] < CONV2D_MIN_CHANNELS:
        return F.conv1d(h, weight, dilation=dilation)
    B, C, T = h.shape
    y = F.conv2d(h.view(B, C, T // dilation, dilation), weight.unsqueeze(-1))  # [B, C_out, T/d - (k-1), d]
    return y.view(B, y.shape[1], -1)


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


def _residual_unit(unit: ResidualUnit, x: torch.Tensor, x_bias: torch.Tensor | None) -> torch.Tensor:
    """unit(x + x_bias) with fused kernels (x_bias: the bias of the conv that produced x, not yet added)."""
    conv1, conv2 = unit.conv1.conv, unit.conv2.conv
    d, T = conv1.dilation[0], x.shape[-1]
    h = snake(x, unit.act1, unit.conv1.left_pad, (-T) % d, bias=x_bias)
    h = dilated_conv(h, conv1.weight, d)[..., :T]
    h = snake(h, unit.act2, bias=conv1.bias)  # conv2 is k=1: no padding
    return residual(x, F.conv1d(h, conv2.weight), x_bias, conv2.bias)


def _vocoder_block(block: VocoderBlock, x: torch.Tensor) -> torch.Tensor:
    act, up, *units = block.block
    h = F.conv_transpose1d(snake(x, act), up.conv.weight, None, stride=up.conv.stride)
    if up.trim:
        h = h[..., : h.shape[-1] - up.trim]
    bias = up.conv.bias
    for unit in units:
        h = _residual_unit(unit, h, bias)
        bias = None
    return h


class FusedVocoderKernels:
    """The vocoder stack (input conv, VocoderBlocks, SnakeBeta, output conv) on the fused kernels above."""

    def vocoder(self, layers, h: torch.Tensor) -> torch.Tensor:
        first, *blocks, act, last = layers
        h = first(h)
        for block in blocks:
            h = _vocoder_block(block, h)
        return last.conv(snake(h, act, last.left_pad))  # SnakeBeta writes the output conv's left padding


def enable_fast_kernels(decoder: Code2WavDecoder) -> bool:
    """Give this decoder instance the fused kernels (CUDA + Triton only). Returns whether it did."""
    if not available(next(decoder.parameters()).device):
        return False
    first, *blocks, act, last = decoder.decoder
    if not (isinstance(first, CausalConv1d) and all(isinstance(b, VocoderBlock) for b in blocks)
            and isinstance(act, SnakeBeta) and isinstance(last, CausalConv1d)):
        raise ValueError("unexpected vocoder layout")
    for block in blocks:
        if not all(u.conv2.left_pad == 0 and u.conv1.conv.padding == (0,) for u in block.block[2:]):
            raise ValueError("unexpected residual unit layout")
    decoder.kernels = FusedVocoderKernels()
    return True


def disable_fast_kernels(decoder: Code2WavDecoder) -> None:
    """Back to the eager modules (bit-exact with the official decoder)."""
    decoder.kernels = None
