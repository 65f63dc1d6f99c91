"""Batch-invariant convolutions: every convolution as one product of its windows and its weight in an order fixed by
the weight's shape, so a batch row's output is computed the same way whatever row it sits in and whatever the other
rows hold. On CUDA the windows are read straight from the input by one Triton kernel (stages/window_product.py); on
a CPU, and in float64, they are copied out (im2col) per time slab and multiplied by aten::mm/addmm.

Why: cuDNN picks and tiles its kernels by the whole problem; at one fixed shape (Code2Wav's deterministic mode fixes
every forward's shape) it still computed a row differently by its position in the batch (H200, bf16: rows 0, 1 and 4
of a 64-row forward equal, rows 15, 32, 48 and 63 not, first at `decoder.0.conv`). A product of one shape computes
its output rows alike (the primitive the Talker's deterministic mode relies on too), so here:
- a convolution is its windows times the weight viewed as [K, C_out]: on CUDA (tap, channel block) by (tap, channel
  block) into one fp32 accumulator per output tile; elsewhere im2col (`Tensor.unfold`, copied per slab into [rows x K])
  (`torch.addmm`; the K order follows the weight's memory, so the view is free for channel-first and channels-last
  weights alike), the bias in the product's epilogue: one fp32 sum, rounded once, as cuDNN;
- a depthwise convolution (groups == channels, the ConvNeXt block's) is k elementwise products summed in fp32 in a
  fixed tap order (separate kernels: no fused multiply-add in one code path only), rounded once (a product of K = k
  per channel would waste the GEMM);
- a transposed convolution (stride s, kernel k, dilation 1) is its sub-pixel form: output block q (s samples) is
  sum_i x[q - i] W_i over the m = ceil(k / s) input samples that reach it, i.e. im2col of m taps times the weight
  rearranged to [(m, C_in), (s, C_out)]: one product whose columns are the block's s samples, no overlap-add, one
  rounding (the same multiply-adds as a GEMM + overlap-add of the k taps).
The im2col form's memory is bounded by slabs: each product covers all rows for `slab` consecutive output positions,
`slab` a function of the problem's shape alone (rows x (K + N) elements <= SLAB_ELEMENTS; the last slab is
shorter), so the slab boundaries, and with them every row's arithmetic, do not depend on a row's place or on the
other rows' contents.

A 2-D convolution whose kernel, stride, padding and output padding are trivial (1, 1, 0, 0) along one axis is a 1-D
one along the other (the fused vocoder's height-1 and (time / d, d) views); that axis rides along as rows. Shapes
outside what this covers (general grouped convolutions, kernels that are not 1 along two axes, dilated transposed
convolutions, dtypes that differ) go to aten's own kernels (`aten::_convolution`, cuDNN on CUDA: not row-invariant):
`fallbacks` counts them, and the Code2Wav tests assert the decoder never takes one. The output has the memory format
aten's would (`torch._C._conv_determine_backend_memory_format`, as FakeTensor computes it: Inductor asserts it).

`enable()` / `disable()` (refcounted; `invariant_conv()` is both as a context manager) register `convolution` as the
implementation of aten::convolution for the device types in DEVICE_TYPES ("CUDA"; tests: "CPU"). That covers eager
F.conv1d/conv2d/conv_transpose1d/2d and nn.Conv*/ConvTranspose* (they all call aten::convolution) and torch.compile'd
code: without max-autotune Inductor emits a convolution as `extern_kernels.convolution(...)`, a call of
torch.convolution through the dispatcher at run time (so also inside CUDA-graph captures of it); a graph captured
before `enable()` keeps the cuDNN kernels it recorded. Not covered: Inductor's Triton conv templates (max-autotune
only), `cpp_wrapper` and AOTInductor. The im2col form's products go through aten::mm/addmm (BLAS, at shapes that
follow the forward's alone).
"""

from __future__ import annotations

import math

import torch

from stages import window_product
from stages.aten_override import AtenOverride

SLAB_ELEMENTS = 1 << 27  # rows x (K + N) of one slab's product: 256 MiB of im2col + product output in bf16
DEVICE_TYPES = ("cuda",)  # where `enable()` registers the override (tests: ("cpu",))
fallbacks = 0  # convolutions passed to aten's kernels since import


def covers(device: torch.device) -> bool:
    """Whether `enable()` reroutes this device's convolutions."""
    return device.type in DEVICE_TYPES


# ---------------------------------------------------------------------------------------------- the convolution
def convolution(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride, padding, dilation,
                transposed: bool, output_padding, groups: int) -> torch.Tensor:
    """aten::convolution's contract (batched input [B, C, *spatial], 1-D or 2-D), row-invariantly (module docstring)."""
    stride, padding, dilation, output_padding = (list(v) for v in (stride, padding, dilation, output_padding))
    axis = _conv_axis(x, weight, bias, stride, padding, output_padding, transposed, groups)
    if axis is None:
        return _fallback(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    k, s, p, d = weight.shape[2 + axis], stride[axis], padding[axis], dilation[axis]
    length = x.shape[2 + axis]
    if transposed:
        out_len = (length - 1) * s - 2 * p + (k - 1) + output_padding[axis] + 1
    else:
        out_len = (length + 2 * p - d * (k - 1) - 1) // s + 1
    shape = [x.shape[0], weight.shape[1] if transposed else weight.shape[0], *x.shape[2:]]
    shape[2 + axis] = out_len
    out = _output(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, shape)
    if out.numel() == 0:
        return out
    # the convolved axis last: x [B, C, (other), L], weight [*, *, k], out time-major [B, (other), L_out, C_out]
    last = x.dim() - 1
    xa = x.movedim(2 + axis, last)
    wa = weight.movedim(2 + axis, last)
    if wa.dim() == 4:  # the other axis' kernel is 1
        wa = wa.squeeze(2)
    out_tm = out.movedim(2 + axis, last).movedim(1, -1)
    if transposed:
        _transposed(xa, wa, bias, s, p, out_tm)
    elif groups == 1:
        _dense(xa, wa, bias, s, p, d, out_tm)
    else:
        _depthwise(xa, wa, bias, s, p, d, out_tm)
    return out


def _conv_axis(x, weight, bias, stride, padding, output_padding, transposed, groups) -> int | None:
    """The one spatial axis the convolution runs along (None: not a shape this module computes)."""
    spatial = x.dim() - 2
    if spatial not in (1, 2) or weight.dim() != x.dim() or x.dtype != weight.dtype or x.device != weight.device:
        return None
    if bias is not None and (bias.dtype != x.dtype or bias.dim() != 1):
        return None
    if not x.is_floating_point() or x.is_complex():
        return None
    channels = x.shape[1]
    if transposed:
        if groups != 1:
            return None
    elif groups != 1 and not (weight.shape[1] == 1 and groups == channels == weight.shape[0]):
        return None  # general grouped convolutions: not needed here
    if (weight.shape[0] if transposed else weight.shape[1] * groups) != channels:
        return None
    moving = [a for a in range(spatial) if weight.shape[2 + a] != 1 or stride[a] != 1 or padding[a] != 0
              or output_padding[a] != 0]
    if len(moving) > 1:
        return None
    return moving[0] if moving else spatial - 1


def _fallback(*args) -> torch.Tensor:
    global fallbacks
    fallbacks += 1
    cudnn = torch.backends.cudnn
    return torch.ops.aten._convolution.default(*args, cudnn.benchmark, cudnn.deterministic, cudnn.enabled,
                                               cudnn.allow_tf32)


def _output(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups, shape) -> torch.Tensor:
    """An empty output in the memory format aten's convolution (and FakeTensor, which Inductor asserts) gives."""
    backend = torch._C._select_conv_backend(x, weight, bias, stride, padding, dilation, transposed, output_padding,
                                            groups, None)
    xi, wi = x, weight
    if weight.dim() == 3:  # as FakeTensor: 1-D problems are judged as contiguous height-1 2-D ones
        xi, wi = torch.empty(x.shape, dtype=x.dtype, device="meta").unsqueeze(2), weight.unsqueeze(2)
    fmt = torch._C._conv_determine_backend_memory_format(xi, wi, backend)
    if fmt == torch.channels_last and len(shape) == 3:
        return torch.empty(shape[0], shape[1], 1, shape[2], dtype=x.dtype, device=x.device,
                           memory_format=fmt).squeeze(2)
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)


# ---------------------------------------------------------------------------------------------- the three forms
def _slab(rows: int, width: int, length: int) -> int:
    """Output positions per product: `rows` x `width` elements each; a function of the problem's shape only."""
    return max(1, min(length, SLAB_ELEMENTS // max(1, rows * width)))


def _pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """x zero-padded along its last axis (`right` < 0 crops)."""
    if left == 0 and right == 0:
        return x
    return torch.constant_pad_nd(x, (left, right))


def _weight_kc(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """w [O, C, k] as [O, K] and whether K is ordered (tap, channel): whichever order is a view of its memory."""
    if w.transpose(1, 2).is_contiguous():  # channels-last weights (the fused vocoder's)
        return w.transpose(1, 2).reshape(w.shape[0], -1), True
    return w.reshape(w.shape[0], -1), False


def _columns(win: torch.Tensor, taps_first: bool) -> torch.Tensor:
    """im2col rows [(B, other, n), K] from windows [B, C, (other), n, taps] (a view), K in the weight's order."""
    cols = win.movedim(1, -1) if taps_first else win.movedim(1, -2)
    return cols.reshape(-1, cols.shape[-2] * cols.shape[-1])


def _product(cols: torch.Tensor, w_kn: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor) -> None:
    """target (M x N elements, row-major [M, N] order) = cols [M, K] @ w_kn [K, N] (+ bias): written in place when
    target is contiguous, else through one temporary."""
    flat = target.is_contiguous()
    dest = target.view(cols.shape[0], w_kn.shape[1]) if flat else None
    if bias is not None:
        y = torch.addmm(bias, cols, w_kn, out=dest) if flat else torch.addmm(bias, cols, w_kn)
    else:
        y = torch.mm(cols, w_kn, out=dest) if flat else torch.mm(cols, w_kn)
    if not flat:
        target.copy_(y.view(target.shape))


def _dense(x, w, bias, s, p, d, out_tm) -> None:
    """groups == 1: on CUDA the windows straight from x (stages/window_product.py); elsewhere per slab of output
    positions, im2col [rows, C k] @ [C k, O]."""
    if window_product.available(x):  # [k, C, O] weight view; out as [B, I, T, 1, O]
        window_product.windows_product(_rows(x), w.permute(2, 1, 0), bias, _rows_out(out_tm).unsqueeze(-2), s, d, p)
        return
    w_ok, taps_first = _weight_kc(w)
    w_kn = w_ok.t()
    k = w.shape[-1]
    span = d * (k - 1) + 1
    xp = _pad(x, p, p)
    out_len = out_tm.shape[-2]
    rows = math.prod(out_tm.shape[:-2])
    slab = _slab(rows, w_kn.shape[0] + w_kn.shape[1], out_len)
    for t0 in range(0, out_len, slab):
        n = min(slab, out_len - t0)
        win = xp.narrow(-1, t0 * s, (n - 1) * s + span).unfold(-1, span, s)[..., ::d]  # [B, C, (other), n, k]
        _product(_columns(win, taps_first), w_kn, bias, out_tm.narrow(-2, t0, n))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, C, (other), L] as [B, C, I, L] (I = 1 for a 1-D convolution): the window kernel's layout."""
    return x if x.dim() == 4 else x.unsqueeze(2)


def _rows_out(out_tm: torch.Tensor) -> torch.Tensor:
    """out_tm [B, (other), L_out, C_out] as [B, I, L_out, C_out]."""
    return out_tm if out_tm.dim() == 4 else out_tm.unsqueeze(1)


def _depthwise(x, w, bias, s, p, d, out_tm) -> None:
    """groups == channels, one filter each: k fp32 multiply-adds per output in tap order, rounded once."""
    C, k = w.shape[0], w.shape[-1]
    taps = w.reshape(C, k).float()
    xp = _pad(x, p, p)
    out_len = out_tm.shape[-2]
    rows = math.prod(out_tm.shape[:-2])
    slab = _slab(rows, 3 * C, out_len)  # the fp32 accumulator and one tap's input
    view = [C] + [1] * (x.dim() - 2)  # taps broadcast over [C, (other), n]
    for t0 in range(0, out_len, slab):
        n = min(slab, out_len - t0)
        acc = None
        for j in range(k):
            xj = xp.narrow(-1, t0 * s + j * d, (n - 1) * s + 1)[..., ::s]  # [B, C, (other), n]
            wj = taps[:, j].view(view)
            term = xj.float() * wj  # a multiply and an add, each rounded: no fused multiply-add in one path only
            acc = term if acc is None else acc.add_(term)
        if bias is not None:
            acc += bias.float().view(view)
        out_tm.narrow(-2, t0, n).copy_(acc.movedim(1, -1))


def _transposed(x, w, bias, s, p, out_tm) -> None:
    """Sub-pixel form (module docstring): block q of the full output = [x[q - m + 1], ..., x[q]] @ W' with
    W'[(a, c), (r, o)] = w[c, o, (m - 1 - a) s + r] (zero past the kernel); the output is the full one from p on."""
    C, C_out, k = w.shape
    m = -(-k // s)
    out_len = out_tm.shape[-2]
    blocks = -(-(p + out_len) // s)
    wp = _pad(w, 0, m * s - k).reshape(C, C_out, m, s).flip(2)  # [C, O, a, r]
    if window_product.available(x):
        _transposed_windows(x, wp, bias, s, p, out_tm, blocks)
        return
    taps_first = x.stride(1) == 1  # the im2col copy reads channels contiguously from time-major inputs
    w_kn = (wp.permute(2, 0, 3, 1) if taps_first else wp.permute(0, 2, 3, 1)).reshape(m * C, s * C_out)
    b = bias.repeat(s) if bias is not None else None
    xp = _pad(x, m - 1, blocks - x.shape[-1])  # blocks + m - 1 samples: window q is xp[q : q + m]
    rows = math.prod(out_tm.shape[:-2])
    slab = _slab(rows, m * C + s * C_out, blocks)
    for q0 in range(0, blocks, slab):
        n = min(slab, blocks - q0)
        cols = _columns(xp.narrow(-1, q0, n + m - 1).unfold(-1, m, 1), taps_first)
        first, end = max(q0 * s, p), min((q0 + n) * s, p + out_len)  # the full output's positions kept
        target = out_tm.narrow(-2, first - p, end - first)
        if first == q0 * s and end == (q0 + n) * s:
            _product(cols, w_kn, b, target.unflatten(-2, (n, s)))
        else:  # the slab overlaps the padding cut: through a temporary
            y = torch.addmm(b, cols, w_kn) if b is not None else torch.mm(cols, w_kn)
            y = y.view(*out_tm.shape[:-2], n * s, C_out)
            target.copy_(y.narrow(-2, first - q0 * s, end - first))


def _transposed_windows(x, wp, bias, s, p, out_tm, blocks) -> None:
    """The sub-pixel form through the window kernel: windows of m taps ending at each block, W' as [m, C, s x O].
    When the kept positions start and end on block boundaries the blocks land in the output directly (windows
    shifted by the p / s blocks cut); otherwise every block goes through a temporary and the kept span is copied."""
    C, C_out, m = wp.shape[0], wp.shape[1], wp.shape[2]
    w_jcn = wp.permute(2, 0, 3, 1).reshape(m, C, s * C_out)
    out = _rows_out(out_tm)
    out_len = out.shape[-2]
    if p % s == 0 and out_len % s == 0:
        window_product.windows_product(_rows(x), w_jcn, bias, out.unflatten(-2, (out_len // s, s)), 1, 1,
                                       m - 1 - p // s)
        return
    full = torch.empty(*out.shape[:2], blocks, s, C_out, dtype=x.dtype, device=x.device)
    window_product.windows_product(_rows(x), w_jcn, bias, full, 1, 1, m - 1)
    out.copy_(full.flatten(2, 3).narrow(-2, p, out_len))


# ---------------------------------------------------------------------------------------------- the switch
def _register(dispatch_key: str) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("convolution", convolution, dispatch_key)
    return lib


_switch = AtenOverride("invariant_conv", lambda: [_register(t.upper()) for t in DEVICE_TYPES])
# Route aten::convolution on DEVICE_TYPES through `convolution` from `enable()` until the matching `disable()`
# (refcounted; `invariant_conv()` is both as a context manager)
enable, disable, enabled, invariant_conv = _switch.enable, _switch.disable, _switch.enabled, _switch.scope
