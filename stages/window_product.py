"""A convolution's windows times its weight in one Triton kernel, without materializing im2col.

    out[b, i, t, r, o] = sum over taps j, channels c of x[b, c, i, t * STEP + j * DIL - PAD] * w[j, c, r * O + o]
                         (+ bias[o]), positions outside [0, L) reading zeros

For every output row (b, i, t) the sum runs over the same (tap, channel-block) sequence, BLOCK_K channels at a time
into one fp32 accumulator, rounded once; the tiles are a function of the weight's shape (`tiles`), never of the row
count. So a row's bits do not depend on how many rows share the launch or where it sits: the property
stages/invariant_conv.py needs, which it had through im2col + a product per slab, at the cost of writing and
reading each input sample once per tap (the decoder's late convolutions are 7 taps over ~30,000 samples per row).
Here each program reads its rows' windows straight from the input.

`invariant_conv` calls it on CUDA with the problem laid out as x [B, C, I, L] (I: the axis that rides along as
rows, 1 for a 1-D convolution), w [J, C, N] and out [B, I, T, R, O] (R = 1 except for the transposed convolution's
sub-pixel form, whose R samples of a block are its columns), any strides. CPU keeps im2col (no Triton in the CPU
install); tests/interpreted/window_product.py runs this kernel under Triton's interpreter against aten's
convolutions, and tests/interpreted/compile_sm90.py compiles its tiles for the H200.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: invariant_conv keeps im2col there
    triton = None


@dataclass(frozen=True, slots=True)
class ConvTiles:
    block_m: int  # output rows (b, i, t) per program
    block_n: int  # output columns (r, o) per program
    block_k: int  # channels per step of the K loop (one tap at a time)
    num_warps: int
    num_stages: int


# The H200 sweep's fastest tiles per (C, N) over a deterministic decode's calls of the released 1.7B decoder
# (`python -m bench.kernels.window_product --streams 64 --sweep --tiles-table`; docs/benchmarks.md): 24% less time
# than the fallback below summed over the decode. Any tiles fixed per (C, N) keep a row's bits apart from its batch.
SWEPT = {
    (96, 1): ConvTiles(128, 16, 32, 4, 3),
    (96, 96): ConvTiles(128, 128, 32, 8, 3),
    (192, 192): ConvTiles(256, 64, 32, 8, 3),
    (192, 288): ConvTiles(256, 64, 32, 8, 3),
    (256, 512): ConvTiles(128, 16, 64, 4, 3),
    (384, 384): ConvTiles(128, 128, 32, 8, 3),
    (384, 768): ConvTiles(128, 128, 32, 8, 3),
    (512, 1024): ConvTiles(64, 64, 64, 4, 3),
    (768, 768): ConvTiles(128, 128, 32, 8, 3),
    (768, 1920): ConvTiles(128, 128, 32, 8, 3),
    (1024, 1536): ConvTiles(64, 128, 32, 4, 3),
    (1024, 2048): ConvTiles(64, 128, 32, 4, 3),
}


def tiles(channels: int, columns: int) -> ConvTiles:
    """Tiles for C input channels and N = R x O output columns: a function of the weight's shape only (the row count
    never picks them): `SWEPT`'s where the sweep timed that problem; otherwise 128 rows per program (rows are many:
    batch x samples), 64 columns (16 below 64: a 1-channel output convolution), 32 channels per K step (divides
    the decoder's 96 x 2^n)."""
    if (channels, columns) in SWEPT:
        return SWEPT[(channels, columns)]
    if columns >= 64:
        return ConvTiles(128, 64, 32, 8, 3)
    return ConvTiles(128, 16, 32, 4, 3)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: `t`'s for the launches in the block, where it is another."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


if triton is not None:

    @triton.jit
    def grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of `tile` in the grouped order: GROUP_M row tiles take each column tile in turn
        (which program computes a tile changes nothing in what it computes)."""
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows

    @triton.jit(do_not_specialize=["M", "T_OUT", "L", "INNER"])
    def _window_product_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, M, N, C, TAPS, T_OUT, L, INNER, OUT_CH,
        sx_b, sx_c, sx_i, sx_l, sw_j, sw_c, sw_n, so_b, so_i, so_t, so_r, so_o, STEP, DIL, PAD,
        BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        t = rm % T_OUT
        q = rm // T_OUT
        inner = q % INNER
        b = q // INNER
        x_rows = b.to(tl.int64) * sx_b + inner.to(tl.int64) * sx_i
        start = t * STEP - PAD
        w_cols = rn.to(tl.int64) * sw_n
        blocks_c = tl.cdiv(C, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for step in range(0, TAPS * blocks_c):  # (tap, channel block) in one order, one loop (pipelined)
            j = step // blocks_c
            c = (step % blocks_c) * BLOCK_K + rk
            c_ok = c < C
            pos = start + j * DIL
            row_ok = m_ok & (pos >= 0) & (pos < L)
            a = tl.load(x_ptr + (x_rows + pos.to(tl.int64) * sx_l)[:, None] + (c.to(tl.int64) * sx_c)[None, :],
                        mask=row_ok[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(w_ptr + j * sw_j + (c.to(tl.int64) * sw_c)[:, None] + w_cols[None, :],
                        mask=c_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        o = rn % OUT_CH
        if BIAS:  # before the one rounding, as cuDNN's epilogue
            acc += tl.load(bias_ptr + o, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        rows = b.to(tl.int64) * so_b + inner.to(tl.int64) * so_i + t.to(tl.int64) * so_t
        cols = (rn // OUT_CH).to(tl.int64) * so_r + o.to(tl.int64) * so_o
        tl.store(out_ptr + rows[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what tl.dot takes into its fp32 accumulator


def available(x: torch.Tensor) -> bool:
    """Whether the kernel runs on `x`: CUDA with Triton, or any device under Triton's interpreter (how the CPU tests
    run it), in a dtype of DTYPES (float64 keeps im2col and its float64 products)."""
    return (triton is not None and x.dtype in DTYPES
            and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def windows_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, step: int,
                    dilation: int, pad: int, config: ConvTiles | None = None) -> torch.Tensor:
    """out [B, I, T, R, O] = the windows of x [B, C, I, L] (T of them, `step` apart, taps `dilation` apart, starting
    `pad` before position 0) times w [J, C, R * O] (+ bias [O]); any strides, one dtype."""
    B, C, inner, L = x.shape
    taps, _, n = w.shape
    T, R, out_ch = out.shape[2], out.shape[3], out.shape[4]
    if (w.shape[1] != C or R * out_ch != n or out.shape[:2] != (B, inner)
            or (bias is not None and bias.shape != (out_ch,))):
        raise ValueError(f"windows_product: shapes x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}")
    m = B * inner * T
    if out.numel() == 0:
        return out
    cfg = config or tiles(C, n)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    with on_device(x):
        _window_product_kernel[grid](
            x, w, out, bias if bias is not None else out, m, n, C, taps, T, L, inner, out_ch,
            x.stride(0), x.stride(1), x.stride(2), x.stride(3), *w.stride(), *out.stride(), step, dilation, pad,
            BIAS=bias is not None, IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, GROUP_M=8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return out
