"""Hopper-oriented variants of the batch-invariant GEMM (stages/invariant_matmul.py), chosen by `Tiles` fields; the
tile sweep (`python -m bench.kernels.invariant_matmul --sweep`) times them and `tiles()` takes those it found fastest.

- `tma`: the operands' tiles arrive through TMA (device-side tensor descriptors, `tl.make_tensor_descriptor`: the
  copy engine fills shared memory asynchronously, out-of-bounds rows and columns read as zeros) instead of masked
  pointer loads. The descriptors live in a per-launch global scratch that Triton asks `triton.set_allocator`'s
  function for (a ContextVar: set on every launch, in the launching thread). TMA wants 16-byte aligned bases and
  leading strides and a unit inner stride; operands that break this (a column slice, a transposed A) take the
  pointer loads of the same variant. That choice follows the layout, never the row count or a row's position: a
  row slice keeps its parent's alignment whenever its row stride is 16-byte aligned, and a size-1 dimension's
  stride is not looked at.
- `persistent`: min(SMs, tiles) programs, each walking the tiles pid, pid + SMs, ... in the grouped order (one
  flattened loop, so the next tile's loads overlap this tile's epilogue). Which program computes a tile changes
  nothing in what it computes: every tile runs the same K loop.
- `split_k` S > 1: the K range cut in S chunks (whole multiples of SPLIT_GRANULE columns, fixed by (K, S)),
  S programs per tile writing fp32 partials [S, B, M, N], then a second kernel summing them in the order 0..S-1,
  adding the bias and rounding once. No atomics: an element's sum is the same whatever M. For products with few
  tiles at decode (the code predictor's), where one tile per program leaves SMs idle.
"""

from __future__ import annotations

import contextlib
import functools

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: stages/invariant_matmul.py refuses before reaching this module's kernels
    triton = None

MAX_GRID_Y = 65535
SUM_BLOCK_M, SUM_BLOCK_N = 16, 128  # the split-K sum's tile (elementwise: any tile gives the same bits)
SPLIT_GRANULE = 128  # split-K chunks are whole multiples of this many K columns, whatever BLOCK_K (<= it, dividing it)
INTERPRETER_SMS = 3  # CPU (Triton's interpreter): few "SMs", so every persistent program walks several tiles


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: `t`'s for the launches in the block, where it is another (the
    GEMM's and the window kernel's launchers)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()

if triton is not None:

    @triton.jit
    def grouped_tile(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """(row tile, column tile) of `tile` in the grouped order: GROUP_M row tiles take each column tile in turn
        (which program computes a tile changes nothing in what it computes; the window kernel of
        stages/window_product.py walks its tiles the same way)."""
        per_group = GROUP_M * tiles_n
        first_m = (tile // per_group) * GROUP_M
        group_rows = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows

    @triton.jit
    def output_tile(a_src, b_src, c_ptr, bias_ptr, pid_m, pid_n, M, N, k_lo, k_hi,
                    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_biasm, stride_biasn,
                    BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr, PARTIAL: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] output tile over K in [k_lo, k_hi), BLOCK_K at a time in increasing K (a_src and
        b_src: descriptors with TMA, else pointers to this batch entry); stores the fp32 sum (PARTIAL) or the sum
        plus bias rounded to c's dtype. The plain kernel (stages/invariant_matmul.py) is this with pointer loads over
        the whole K."""
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        if TMA:
            for k0 in range(k_lo, k_hi, BLOCK_K):  # chunks end on a BLOCK_K boundary or at K (zero padded)
                a = a_src.load([pid_m * BLOCK_M, k0])
                if B_KMAJOR:  # nn.Linear's weight.t(): [N, K] rows in memory
                    b = b_src.load([pid_n * BLOCK_N, k0]).T
                else:
                    b = b_src.load([k0, pid_n * BLOCK_N])
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
        else:
            rk = tl.arange(0, BLOCK_K)
            m_ok = rm < M
            n_ok = rn < N
            a_ptrs = a_src + rm[:, None] * stride_am + (k_lo + rk)[None, :] * stride_ak
            b_ptrs = b_src + (k_lo + rk)[:, None] * stride_bk + rn[None, :] * stride_bn
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k_ok = rk < k_hi - k0
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        ok = (rm < M)[:, None] & (rn < N)[None, :]
        c_ptrs = c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn
        if PARTIAL:
            tl.store(c_ptrs, acc, mask=ok)
        else:
            if BIAS:  # before the rounding, as addmm's epilogue
                acc += tl.load(bias_ptr + rm[:, None] * stride_biasm + rn[None, :] * stride_biasn, mask=ok,
                               other=0.0).to(tl.float32)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["M"])
    def _variant_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, K_CHUNK,
        stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
        stride_cs, stride_cb, stride_cm, stride_cn, stride_biasm, stride_biasn,
        BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr, B_KMAJOR: tl.constexpr,
        PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr, SPLIT: tl.constexpr,
    ):
        # axis 0: the tile (or, persistent, the program walking tiles), 1: the batch entry, 2: the K chunk
        batch = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        k_lo = split * K_CHUNK
        k_hi = min(K, k_lo + K_CHUNK)
        a_src = a_ptr + batch * stride_ab
        b_src = b_ptr + batch * stride_bb
        c_out = c_ptr + split.to(tl.int64) * stride_cs + batch * stride_cb
        if TMA:
            a_src = tl.make_tensor_descriptor(a_src, shape=[M, K], strides=[stride_am, 1],
                                              block_shape=[BLOCK_M, BLOCK_K])
            if B_KMAJOR:
                b_src = tl.make_tensor_descriptor(b_src, shape=[N, K], strides=[stride_bn, 1],
                                                  block_shape=[BLOCK_N, BLOCK_K])
            else:
                b_src = tl.make_tensor_descriptor(b_src, shape=[K, N], strides=[stride_bk, 1],
                                                  block_shape=[BLOCK_K, BLOCK_N])
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        if PERSISTENT:
            for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True):
                pid_m, pid_n = grouped_tile(tile, tiles_m, tiles_n, GROUP_M)
                output_tile(a_src, b_src, c_out, bias_ptr, pid_m, pid_n, M, N, k_lo, k_hi, stride_am, stride_ak,
                            stride_bk, stride_bn, stride_cm, stride_cn, stride_biasm, stride_biasn, BIAS, IEEE,
                            BLOCK_M, BLOCK_N, BLOCK_K, TMA, B_KMAJOR, SPLIT > 1)
        else:
            pid_m, pid_n = grouped_tile(tl.program_id(0), tiles_m, tiles_n, GROUP_M)
            output_tile(a_src, b_src, c_out, bias_ptr, pid_m, pid_n, M, N, k_lo, k_hi, stride_am, stride_ak,
                        stride_bk, stride_bn, stride_cm, stride_cn, stride_biasm, stride_biasn, BIAS, IEEE, BLOCK_M,
                        BLOCK_N, BLOCK_K, TMA, B_KMAJOR, SPLIT > 1)

    @triton.jit(do_not_specialize=["M"])
    def _sum_splits_kernel(
        part_ptr, c_ptr, bias_ptr, M, N, stride_ps, stride_pb, stride_pm, stride_cb, stride_cm, stride_cn,
        stride_biasm, stride_biasn,
        SPLIT: tl.constexpr, BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """c = ((partial 0 + partial 1) + ... + partial SPLIT-1) + bias, rounded once to c's dtype."""
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        batch = tl.program_id(2).to(tl.int64)
        ok = (rm < M)[:, None] & (rn < N)[None, :]
        parts = part_ptr + batch * stride_pb + rm[:, None] * stride_pm + rn[None, :]
        acc = tl.load(parts, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(parts + s * stride_ps, mask=ok, other=0.0)
        if BIAS:
            acc += tl.load(bias_ptr + rm[:, None] * stride_biasm + rn[None, :] * stride_biasn, mask=ok,
                           other=0.0).to(tl.float32)
        tl.store(c_ptr + batch * stride_cb + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=ok)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Triton's global scratch for the device-side TMA descriptors, on the current device and stream (the caching
    allocator: inside a CUDA-graph capture, from the graph's pool). 256-byte aligned >= any `alignment` asked."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tma_strides(t: torch.Tensor, inner: int) -> tuple[int, int, int] | None:
    """The strides with which 2-D descriptors over the last two dimensions of the 3-D operand t, dimension `inner`
    (1 or 2) contiguous, read it; None when TMA cannot (base or batch/outer stride not a multiple of 16 bytes,
    `inner` not contiguous). A size-1 dimension is never stepped along: its stride is replaced by an aligned one,
    so a single row reads the way it does inside a larger product."""
    unit = 16 // t.element_size()
    outer = 3 - inner
    strides = list(t.stride())
    if t.shape[0] == 1:
        strides[0] = 0
    if t.shape[outer] == 1:
        strides[outer] = -(-t.shape[inner] // unit) * unit
    if t.shape[inner] == 1:
        strides[inner] = 1
    ok = t.data_ptr() % 16 == 0 and strides[inner] == 1 and strides[0] % unit == 0 and strides[outer] % unit == 0
    return (strides[0], strides[1], strides[2]) if ok else None


def launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, cfg) -> torch.Tensor:
    """out[i] = a[i] @ b[i] (+ bias) through the variant `cfg` (a Tiles with tma, persistent or split_k set) for 3-D
    a [B, M, K], b [B, K, N], out [B, M, N] (non-empty, K > 0), on a's device (the caller's device context)."""
    batch, m, k = a.shape
    n = b.shape[2]
    a_strides, b_strides, b_kmajor, tma = a.stride(), b.stride(), False, False
    if cfg.tma:
        a_tma = _tma_strides(a, 2)
        b_kmajor_tma = _tma_strides(b, 1)  # K contiguous: nn.Linear's weight.t()
        b_tma = b_kmajor_tma or _tma_strides(b, 2)
        if a_tma is not None and b_tma is not None:
            a_strides, b_strides, b_kmajor, tma = a_tma, b_tma, b_kmajor_tma is not None, True
    if tma and a.is_cuda:
        triton.set_allocator(_scratch)
    split = cfg.split_k
    # whole SPLIT_GRANULE multiples (split 1: >= K), so the chunks do not follow BLOCK_K (tiles of one split count
    # give the same bits)
    granule = SPLIT_GRANULE if split > 1 else cfg.block_k
    chunk = triton.cdiv(triton.cdiv(k, split), granule) * granule
    bias_strides = bias.stride() if bias is not None else (0, 0)
    sms = _sm_count(a.device)
    per_launch = MAX_GRID_Y
    for b0 in range(0, batch, per_launch):
        a_, b_, out_ = a[b0:b0 + per_launch], b[b0:b0 + per_launch], out[b0:b0 + per_launch]
        entries = a_.shape[0]
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        if split > 1:
            target = torch.empty((split, entries, m, n), dtype=torch.float32, device=a.device)
        else:
            target = out_.unsqueeze(0)
        grid = (min(sms, tiles) if cfg.persistent else tiles, entries, split)
        _variant_kernel[grid](
            a_, b_, target, bias if bias is not None else out_, m, n, k, chunk,
            a_strides[0], a_strides[1], a_strides[2], b_strides[0], b_strides[1], b_strides[2],
            *target.stride(), *bias_strides,
            BIAS=bias is not None and split == 1, IEEE=a.dtype == torch.float32, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, TMA=tma, B_KMAJOR=b_kmajor,
            PERSISTENT=cfg.persistent, NUM_SMS=sms, SPLIT=split, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if split > 1:
            _sum_splits_kernel[(triton.cdiv(m, SUM_BLOCK_M), triton.cdiv(n, SUM_BLOCK_N), entries)](
                target, out_, bias if bias is not None else out_, m, n, *target.stride()[:3], *out_.stride(),
                *bias_strides, SPLIT=split, BIAS=bias is not None, BLOCK_M=SUM_BLOCK_M, BLOCK_N=SUM_BLOCK_N,
                num_warps=4,
            )
    return out
