"""Fused CUDA kernels for the code2wav vocoder, switched on per decoder instance by the engine (serving path).

Profiled on an H100 (bf16, batch 64 x 75 frames, docs/code2wav.md), the eager vocoder spent most of its
time outside the convolutions' arithmetic: SnakeBeta as five broadcast kernels with four temporaries,
the conv biases added by separate non-vectorized broadcast kernels, a left-padded copy of every causal
conv input, one cuDNN fallback kernel (no tensor cores) for the dilation-9 conv at 384 channels, and
cuDNN's own NCHW <-> NHWC transposes around every tensor-core conv (~20% of the decoder's time).
`enable_fast_kernels(decoder)` gives that decoder instance `FusedVocoderKernels` (its `kernels` seam, as
the talker's layers take `LayerKernels`), which run the vocoder **time-major**: every activation is a
[B, C, T] tensor whose memory is [B, T, C] (channels contiguous: cuDNN's NHWC, so its tensor-core convs
read and write it as is), and
- one Triton SnakeBeta kernel (fp32 math, one read, one write) that also adds the previous conv's bias
  and writes the next conv's zero padding, so no padded copy is made;
- causal convs as channels-last 2-D convs over a height-1 view, k=1 convs as one GEMM over (B x T) rows,
  dilated convs from CONV2D_MIN_CHANNELS up as 2-D convs over a (time / dilation, dilation) view (same
  arithmetic; in this layout the view is free), convs without bias;
- one Triton kernel for `x + bias + conv(h) + bias` at the end of each residual unit, which also writes the
  SnakeBeta of its result that the next conv reads (one pass over the activations fewer per unit).
Parameters and modules are untouched (their weights are viewed as 2-D / channels-last copies, cached per
module). The output equals the eager decoder up to rounding (fp32 inside the kernels, rounded once); use the
eager modules (`disable_fast_kernels`) for bit parity. On CPU tensors the two Triton kernels fall back to the
same math in PyTorch, so the layout plumbing runs (and is tested) without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stages.code2wav.layers import CausalConv1d, ResidualUnit, SnakeBeta, VocoderBlock
from stages.code2wav.model import Code2WavDecoder

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_BLOCK_T, _BLOCK_C = 64, 64
# Choices measured per op and shape (docs/code2wav.md section 7):
Carry = Callable[[str, torch.Tensor, int], torch.Tensor]  # (state key, padded conv input, rate) -> conv input

CONV2D_MIN_CHANNELS = 0  # dilated convs with at least this many input channels run as (T / d, d) 2-D convs
UPSAMPLE_GEMM_MIN_CHANNELS = 1024  # transposed convs with at least this many input channels as a GEMM + an add


if triton is not None:

    @triton.jit
    def _sin(x, FAST: tl.constexpr):
        """sin(x) in fp32. FAST (CUDA): the argument reduced to [-pi, pi] by two FMAs (2 pi split in a high and a low
        part), then the SFU's `sin.approx` (absolute error ~1e-6 there). tl.sin is libdevice's sinf, whose exact
        reduction for any argument (a local-memory table, ~30 instructions on its fast path) made SnakeBeta, a
        one-read one-write kernel, bound by arithmetic instead of memory bandwidth; the result is rounded to bf16
        (relative step 2^-8) right after. Not FAST: tl.sin (Triton's interpreter runs no inline PTX)."""
        if FAST:
            k = tl.floor(x * 0.15915494309189535 + 0.5)
            r = tl.fma(-k, 6.2831854820251465, x)
            r = tl.fma(-k, -1.7484555314695172e-07, r)
            return tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return tl.sin(x)

    @triton.jit
    def _snake_kernel(x_ptr, y_ptr, alpha_ptr, inv_beta_ptr, bias_ptr, C, T, stride_xb, stride_xt, T_out, PAD,
                      HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                      FAST_SIN: tl.constexpr = True):
        b = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # output time in [0, T_out)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        src = t - PAD
        inside = (src >= 0) & (src < T) & (c < C)
        x = tl.load(x_ptr + b.to(tl.int64) * stride_xb + src * stride_xt + c, mask=inside, other=0.0).to(tl.float32)
        cm = c < C
        if HAS_BIAS:
            x = x + tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
        s = _sin(x * tl.load(alpha_ptr + c, mask=cm, other=0.0), FAST_SIN)
        y = tl.where(inside, x + tl.load(inv_beta_ptr + c, mask=cm, other=0.0) * (s * s), 0.0)
        tl.store(y_ptr + (b.to(tl.int64) * T_out + t) * C + c, y.to(y_ptr.dtype.element_ty), mask=(t < T_out) & cm)

    @triton.jit
    def _residual_snake_kernel(x_ptr, h_ptr, y_ptr, s_ptr, xb_ptr, hb_ptr, alpha_ptr, inv_beta_ptr, C, T, sxb, sxt,
                               shb, sht, T_out, PAD, HAS_XB: tl.constexpr, HAS_HB: tl.constexpr,
                               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, FAST_SIN: tl.constexpr = True):
        b = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # position in the padded snake output
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        cm = c < C
        src = t - PAD
        inside = (src >= 0) & (src < T) & cm
        x = tl.load(x_ptr + b.to(tl.int64) * sxb + src * sxt + c, mask=inside, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + b.to(tl.int64) * shb + src * sht + c, mask=inside, other=0.0).to(tl.float32)
        if HAS_XB:
            x = x + tl.load(xb_ptr + c, mask=cm, other=0.0).to(tl.float32)
        if HAS_HB:
            h = h + tl.load(hb_ptr + c, mask=cm, other=0.0).to(tl.float32)
        y = (x + h).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + (b.to(tl.int64) * T + src) * C + c, y, mask=inside)
        v = y.to(tl.float32)  # the snake reads what was stored, as an unfused snake would
        sn = _sin(v * tl.load(alpha_ptr + c, mask=cm, other=0.0), FAST_SIN)
        out = tl.where(inside, v + tl.load(inv_beta_ptr + c, mask=cm, other=0.0) * (sn * sn), 0.0)
        tl.store(s_ptr + (b.to(tl.int64) * T_out + t) * C + c, out.to(s_ptr.dtype.element_ty), mask=(t < T_out) & cm)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


# ---------------------------------------------------------------------------------------------- layout
def time_major(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] with channels contiguous in memory ([B, T, C]); a copy only if it is not already."""
    if x.stride(1) == 1 and (x.shape[2] <= 1 or x.stride(2) == x.shape[1]):
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def new_time_major(B: int, C: int, T: int, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(B, T, C, dtype=like.dtype, device=like.device).transpose(1, 2)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A time-major [B, C, T] (any batch / time strides, channel stride 1) and its (batch, time) strides."""
    if x.stride(1) != 1:
        x = time_major(x)
    return x, x.stride(0), x.stride(2)


# ---------------------------------------------------------------------------------------------- kernels
def snake(x: torch.Tensor, act: SnakeBeta, left_pad: int = 0, right_pad: int = 0,
          bias: torch.Tensor | None = None) -> torch.Tensor:  # [B, C, T] -> time-major [B, C, left + T + right]
    """SnakeBeta(x + bias) in one kernel, with `left_pad` / `right_pad` zero columns around the result."""
    x, sxb, sxt = _rows(x)
    B, C, T = x.shape
    alpha, inv_beta = _params(act)
    t_out = left_pad + T + right_pad
    y = new_time_major(B, C, t_out, x)
    if not available(x.device):  # the same math in PyTorch (CPU tests of the layout)
        v = x.float() + (bias.float()[:, None] if bias is not None else 0.0)
        v = v + inv_beta[:, None] * torch.sin(v * alpha[:, None]) ** 2
        y.zero_()[..., left_pad:left_pad + T] = v.to(y.dtype)
        return y
    grid = (B, triton.cdiv(t_out, _BLOCK_T), triton.cdiv(C, _BLOCK_C))
    _snake_kernel[grid](x, y, alpha, inv_beta, bias if bias is not None else alpha, C, T, sxb, sxt, t_out, left_pad,
                        HAS_BIAS=bias is not None, BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C)
    return y


def residual_snake(x: torch.Tensor, h: torch.Tensor, x_bias: torch.Tensor | None, h_bias: torch.Tensor | None,
                  act: SnakeBeta, left_pad: int = 0, right_pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """y = (x + x_bias) + (h + h_bias), the end of a residual unit, and the SnakeBeta that reads y next (with its
    zero columns), in one kernel: (time-major y [B, C, T], time-major snake(y) [B, C, left + T + right])."""
    x, sxb, sxt = _rows(x)
    h, shb, sht = _rows(h)
    B, C, T = x.shape
    t_out = left_pad + T + right_pad
    y, s = new_time_major(B, C, T, x), new_time_major(B, C, t_out, x)
    if not available(x.device):  # the same math in PyTorch (CPU tests of the layout)
        xf = x.float() + (x_bias.float()[:, None] if x_bias is not None else 0.0)
        y.copy_(xf + h.float() + (h_bias.float()[:, None] if h_bias is not None else 0.0))
        return y, snake(y, act, left_pad, right_pad)
    alpha, inv_beta = _params(act)
    dummy = x_bias if x_bias is not None else (h_bias if h_bias is not None else alpha)
    _residual_snake_kernel[(B, triton.cdiv(t_out, _BLOCK_T), triton.cdiv(C, _BLOCK_C))](
        x, h, y, s, x_bias if x_bias is not None else dummy, h_bias if h_bias is not None else dummy, alpha, inv_beta,
        C, T, sxb, sxt, shb, sht, t_out, left_pad, HAS_XB=x_bias is not None, HAS_HB=h_bias is not None,
        BLOCK_T=_BLOCK_T, BLOCK_C=_BLOCK_C)
    return y, s


# ---------------------------------------------------------------------------------------------- convolutions
def conv(x: torch.Tensor, layer: nn.Conv1d, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Conv1d without padding (`layer`'s weight and dilation) over time-major x: time-major [B, C_out, T']."""
    w = _weight(layer, "conv")
    y = F.conv2d(time_major(x).unsqueeze(2), w, bias, dilation=(1, layer.dilation[0]))  # NHWC, H = 1
    return y.squeeze(2)


def dilated_conv(h: torch.Tensor, layer: nn.Conv1d) -> torch.Tensor:
    """Conv1d (no padding, no bias) with `layer`'s dilation d over time-major h, as a 2-D conv over the
    (time / d, d) view when h has >= CONV2D_MIN_CHANNELS channels.

    out[t] = sum_k w[k] h[t + k d]; with t = i d + j that is a conv along i for every column j. In the
    time-major layout the (time / d, d) view is a reshape of the same memory. Needs `h.shape[-1] % d == 0`.
    Why: cuDNN's own dilated kernels fall back to slow ones at some shapes: NCHW 384 ch, d=9, batch 64 x 75
    frames: 53.7 ms against 3.2 ms as the 2-D view; NHWC 192 ch, d=3 and 9, batch 64 x 1 frame: 43.9 ms
    against 1.1 ms channels-first (bench/code2wav_ops.py, H100). The view is a plain (k, 1) conv.
    """
    if layer.dilation[0] == 1 or h.shape[1] < CONV2D_MIN_CHANNELS:
        return conv(h, layer)
    return dilated_view_conv(h, layer)


def dilated_view_conv(h: torch.Tensor, layer: nn.Conv1d) -> torch.Tensor:
    """`dilated_conv` as a 2-D conv over the (time / d, d) view, whatever the channels."""
    d = layer.dilation[0]
    h = time_major(h)
    B, C, T = h.shape
    grid = h.transpose(1, 2).reshape(B, T // d, d, C).permute(0, 3, 1, 2)  # NHWC view [B, C, T / d, d]
    y = F.conv2d(grid, _weight(layer, "dilated"))  # [B, C_out, T / d - (k - 1), d], channels-last
    return y.permute(0, 2, 3, 1).reshape(B, -1, y.shape[1]).transpose(1, 2)


def pointwise(h: torch.Tensor, layer: nn.Conv1d) -> torch.Tensor:
    """A kernel-1 conv (no bias) over time-major h as one GEMM over its B x T rows."""
    h = time_major(h)
    return F.linear(h.transpose(1, 2), _weight(layer, "linear")).transpose(1, 2)


def conv_transpose(x: torch.Tensor, layer: nn.ConvTranspose1d) -> torch.Tensor:
    """ConvTranspose1d (no bias, `layer`'s stride) over time-major x: time-major [B, C_out, (T - 1) s + k]."""
    y = F.conv_transpose2d(time_major(x).unsqueeze(2), _weight(layer, "transpose"), stride=(1, layer.stride[0]))
    return y.squeeze(2)


def upsample_block(carried: torch.Tensor, layer: nn.ConvTranspose1d) -> torch.Tensor:
    """A vocoder block's causal upsampling (see `upsample`): a GEMM + an add from UPSAMPLE_GEMM_MIN_CHANNELS input
    channels up, else cuDNN's transposed conv (faster for the narrower blocks)."""
    if carried.shape[1] >= UPSAMPLE_GEMM_MIN_CHANNELS:
        return upsample(carried, layer)
    r = layer.stride[0]
    return conv_transpose(carried, layer)[..., r:r + (carried.shape[-1] - 1) * r]


def upsample(carried: torch.Tensor, layer: nn.ConvTranspose1d) -> torch.Tensor:
    """The causal transposed conv (kernel 2r, stride r) of the T samples after the first one of `carried`
    (time-major [B, C, 1 + T]; that first sample is the previous chunk's last, or zeros at a stream's start):
    time-major [B, C_out, T r], equal to conv_transpose(carried)[..., r : r + T r].

    As one GEMM and one add: A = carried^T W, [B, 1 + T, 2r, C_out], and output block j (r samples) is
    A[j + 1, :r] + A[j, r:] (the first half of sample j + 1's kernel plus the second half of sample j's)."""
    r = layer.stride[0]
    x = time_major(carried).transpose(1, 2)  # [B, 1 + T, C]
    B, n, _ = x.shape
    a = F.linear(x, _weight(layer, "upsample")).view(B, n, 2, r, -1)  # [B, 1 + T, 2, r, C_out]
    y = torch.add(a[:, 1:, 0], a[:, :-1, 1])  # [B, T, r, C_out]
    return y.view(B, (n - 1) * r, -1).transpose(1, 2)


def _weight(layer: nn.Module, form: str) -> torch.Tensor:
    """`layer.weight` as the fused path reads it, cached on the module until the weight changes:
    conv / transpose: [O, I, 1, k] (transposed: [I, O, 1, k]) channels-last; dilated: [O, I, k, 1] channels-last;
    linear: [O, I]; upsample: [k O, I]. About the vocoder's weights again in memory (~110 MB for the released
    decoder in bf16)."""
    w = layer.weight
    key = (form, w.data_ptr(), w._version, w.device, w.dtype)
    cache = layer.__dict__.setdefault("_fast_weights", {})
    hit = cache.get(form)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        if form == "linear":
            out = w.squeeze(-1).contiguous()
        elif form == "upsample":  # [C_in, C_out, 2r] -> [(2r) C_out, C_in]: row k C_out + o is w[:, o, k]
            out = w.permute(2, 1, 0).reshape(-1, w.shape[0]).contiguous()
        elif form == "dilated":
            out = w.unsqueeze(-1).contiguous(memory_format=torch.channels_last)
        else:
            out = w.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    cache[form] = (key, out)
    return out


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


def pad_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, C, T] after n zero columns, time-major (the one causal conv input not written by a SnakeBeta)."""
    B, C, T = x.shape
    y = new_time_major(B, C, n + T, x)
    y[..., :n] = 0
    y[..., n:] = x
    return y


def no_carry(key: str, padded: torch.Tensor, rate: int) -> torch.Tensor:
    """A stream's start (the stateless decode): each conv's zero columns stay zeros."""
    return padded


def vocoder(layers: nn.ModuleList, h: torch.Tensor, carry: Carry = no_carry, rate: int = 1) -> torch.Tensor:
    """The vocoder stack (input conv, VocoderBlocks, SnakeBeta, output conv) on the kernels above, [B, C, T] ->
    [B, 1, T x prod(rates)].

    Every conv input is written with zero columns in front (its causal history) by the kernel before it;
    `carry(key, padded, rate)` may fill them (`StatefulDecoder`: the stream's carried state, keys as in
    `stateful.carried_convs`; `rate`: samples per frame at that conv) and returns the conv's input. Each residual
    unit ends in one kernel with the SnakeBeta that follows it (the next unit's, the next block's or the last)."""
    first, *blocks, act, last = layers
    h = conv(carry("decoder.first", pad_left(h, first.left_pad), rate), first.conv, first.conv.bias)
    s = snake(h, blocks[0].block[0], 1)  # one column in front: the upsampler's previous input sample
    for b, block in enumerate(blocks):
        _act, up, *units = block.block
        h = upsample_block(carry(f"decoder.{b}.up", s, rate), up.conv)
        rate *= up.conv.stride[0]
        T = h.shape[-1]
        x_bias = up.conv.bias  # added by the kernels that read h
        s = snake(h, units[0].act1, *_unit_pads(units[0], T), bias=x_bias)
        for u, unit in enumerate(units):
            c1 = unit.conv1.conv
            h1 = dilated_conv(carry(f"decoder.{b}.{u}", s, rate), c1)[..., :T]
            h2 = pointwise(snake(h1, unit.act2, bias=c1.bias), unit.conv2.conv)  # conv2 is k=1: no padding
            if u + 1 < len(units):
                following = (units[u + 1].act1, *_unit_pads(units[u + 1], T))
            elif b + 1 < len(blocks):
                following = (blocks[b + 1].block[0], 1, 0)
            else:
                following = (act, last.left_pad, 0)
            h, s = residual_snake(h, h2, x_bias, unit.conv2.conv.bias, *following)
            x_bias = None
    return conv(carry("decoder.last", s, rate), last.conv, last.conv.bias)


def _unit_pads(unit: ResidualUnit, T: int) -> tuple[int, int]:
    """Zero columns around a residual unit's dilated conv input: its causal history, and up to a multiple of d."""
    return unit.conv1.left_pad, (-T) % unit.conv1.conv.dilation[0]


class FusedVocoderKernels:
    """The decoder's `kernels` seam (model.VocoderKernels) on the fused, time-major kernels: `vocoder` above."""

    def vocoder(self, layers: nn.ModuleList, h: torch.Tensor, carry: Carry | None = None,
                rate: int = 1) -> torch.Tensor:
        return vocoder(layers, h, carry or no_carry, rate)


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
        up = block.block[1]
        if up.conv.kernel_size[0] != 2 * up.conv.stride[0] or up.trim != up.conv.stride[0]:
            raise ValueError("vocoder transposed convs must have kernel == 2 x stride")
    decoder.kernels = FusedVocoderKernels()
    return True


def disable_fast_kernels(decoder: Code2WavDecoder) -> None:
    """Back to the eager modules (bit-exact with the official decoder)."""
    decoder.kernels = None
