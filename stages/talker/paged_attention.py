"""Decode attention over a paged KV pool (one query position per row), as Triton kernels on CUDA.

One program per (row, KV head) walks the row's blocks through its block-table row, with an online softmax
over `seq_lens[row]` keys: it reads exactly the keys the row has (no length bucket, no gathered copy),
and all query heads of a GQA group share each key/value load. Shape-static launch (grid = rows x KV heads;
lengths come from a device tensor), so it is captured inside the decode step's CUDA graph.

The kernel runs q k^T and p v on tensor cores (the group's query heads as the rows of a 16-row tile, which lets
Triton fetch K/V tiles ahead asynchronously) or on CUDA cores (each product an fp32 sum in registers), as the
tiling says. The same walk serves a contiguous per-row cache ([B, n_kv, L, D], `contiguous_decode_attention`, each
row one block of L positions): the code predictor's (<= 16 keys), where SDPA's flash kernel, tiled for 64-128
keys, took 51 us per call at batch 256 on an H100 (23% of the decode step).

The reference math is the gather + SDPA path in `DecodeContext` (stages/talker/paged_kv.py); the GPU
tests compare the two (fp32 and bf16 tolerances are stated there).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from stages import pdl
from stages.pdl import launch_args

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine uses the gather path there
    triton = None


def kernel_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class HeadNorm:
    """What turns projected q/k heads into attention's q/k (Qwen3's per-head RMSNorm, then RoPE): given to the
    kernel, it applies them itself while loading q and the new key (`heads_in_attention` in stages/layers.py), so
    they cost no kernels of their own."""

    q_weight: torch.Tensor  # [D]
    k_weight: torch.Tensor  # [D]
    eps: float
    cos: torch.Tensor  # [B, 1, S, D], the rows' positions (Rotary)
    sin: torch.Tensor

    def at(self, position: int) -> HeadNorm:
        """The same for the forward's `position`-th new position alone (one kernel call per new position)."""
        return replace(self, cos=self.cos[:, :, position:position + 1], sin=self.sin[:, :, position:position + 1])

    def args(self) -> tuple:
        """The kernel's (q weight, k weight, cos, sin, eps, row stride of cos/sin) for the forward's first new
        position of every row."""
        cos, sin = self.cos[:, 0, 0], self.sin[:, 0, 0]  # [B, D]
        assert cos.stride(1) == 1 and cos.stride() == sin.stride()
        return self.q_weight, self.k_weight, cos, sin, self.eps, cos.stride(0)


@dataclass(frozen=True)
class DecodeTiling:
    """How `paged_decode_attention` walks a row's keys: `keys` per iteration, `warps` per program, `stages` tiles
    fetched ahead, and on tensor cores or CUDA cores (`decode_tiling` and `contiguous_tiling` choose by the batch;
    heads narrower than 16 always run on CUDA cores)."""

    keys: int
    warps: int
    stages: int = 2
    tensor_cores: bool = False


def _head_args(head_norm: HeadNorm | None, q: torch.Tensor) -> tuple:
    """HeadNorm.args, or placeholders (q's pointer, never read) for a kernel without the head prologue."""
    return head_norm.args() if head_norm is not None else (q, q, q, q, 0.0, 0)


if triton is not None:

    @triton.jit
    def _head_norm_rope(x_ptr, offs, d, w_ptr, cos_ptr, sin_ptr, eps, mask, D: tl.constexpr):
        """`heads_norm_rope` of stages/layers.py on projected head vectors at `offs` [N, D] (`d` [1, D]): per-head
        RMSNorm, then RoPE (rotate-half layout), rounding to the input dtype where the eager ops do. rotate_half's
        other half is a second load at the rotated offsets, not a register shuffle."""
        dt = x_ptr.dtype.element_ty
        half = D // 2
        rot_d = (d + half) % D
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x_rot = tl.load(x_ptr + offs - d + rot_d, mask=mask, other=0.0).to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        w = tl.load(w_ptr + d).to(tl.float32)
        w_rot = tl.load(w_ptr + rot_d).to(tl.float32)
        x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
        x_rot = ((x_rot * rstd).to(dt).to(tl.float32) * w_rot).to(dt).to(tl.float32)
        x_rot = tl.where(d < half, -x_rot, x_rot)
        cos = tl.load(cos_ptr + d).to(tl.float32)
        sin = tl.load(sin_ptr + d).to(tl.float32)
        return ((x * cos).to(dt).to(tl.float32) + (x_rot * sin).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _store_new_kv(k_ptr, v_ptr, table_ptr, kn_ptr, vn_ptr, kw_ptr, cos_ptr, sin_ptr, eps, row, kv_head, last,
                      stride_kblock, stride_kt, stride_kh, stride_tb, stride_knb, stride_knh, stride_vnb, stride_vnh,
                      stride_cb, D: tl.constexpr, PAGE: tl.constexpr, HEADS: tl.constexpr):
        """The row's new key/value to its position `last` (the key through its head norm and RoPE with HEADS)."""
        d1 = tl.arange(0, D)[None, :]  # [1, D]: one head vector, in the 2-D shape the head prologue takes
        last_block = tl.load(table_ptr + row * stride_tb + last // PAGE)
        last_offs = last_block * stride_kblock + (last % PAGE) * stride_kt + kv_head * stride_kh + d1
        kn_offs = row * stride_knb + kv_head * stride_knh + d1
        if HEADS:  # the key as projected: its head norm and RoPE happen here
            k_new = _head_norm_rope(kn_ptr, kn_offs, d1, kw_ptr, cos_ptr + row * stride_cb,
                                    sin_ptr + row * stride_cb, eps, d1 < D, D)
        else:
            k_new = tl.load(kn_ptr + kn_offs)
        v_new = tl.load(vn_ptr + row * stride_vnb + kv_head * stride_vnh + d1)
        tl.store(k_ptr + last_offs, k_new)
        tl.store(v_ptr + last_offs, v_new)
        # bar.sync orders the stores before every thread's loads of them (the same CTA reads them back); a
        # select of the registers in every tile instead made the batch-256 calls ~20% slower (H100)
        tl.debug_barrier()

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, table_ptr, lens_ptr, kn_ptr, vn_ptr, sm_scale,
        qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps, part_ptr, ml_ptr,
        stride_qb, stride_qh, stride_kblock, stride_kt, stride_kh, stride_tb, stride_len, stride_ob, stride_oh,
        stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cb,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, PAGE: tl.constexpr,
        WRITE: tl.constexpr, HEADS: tl.constexpr, SPLITS: tl.constexpr = 1,
        PDL: tl.constexpr = False, TENSOR_CORES: tl.constexpr = False, IEEE: tl.constexpr = False,
    ):
        """With TENSOR_CORES, q k^T and p v are matrix products: the group's query heads are the rows of a
        GROUP_P = 16 tile (the smallest MMA; the rows past GROUP are zeros, never stored), which also lets Triton's
        pipeliner fetch K/V tiles ahead asynchronously. In bf16, q k^T multiplies bf16 operands exactly into fp32
        sums and p v runs in tf32 (p rounded to 10 mantissa bits, v exact), closer to the fp32 math than bf16
        probabilities; fp32 caches (IEEE) use IEEE products. Otherwise each product is an fp32 sum in registers."""
        if PDL:  # programmatic dependent launch: the next kernel may launch now; wait for the previous one's writes
            pdl.begin()
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        seq_len = tl.load(lens_ptr + row * stride_len)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D)
        last = seq_len - 1
        if SPLITS == 1:
            lo = 0
            hi = seq_len
            holds_last = True  # a Python bool: the `if` below is resolved at compile time
        else:  # this program's share of the keys: whole tiles, the last splits possibly empty
            split = tl.program_id(2)
            chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK) * BLOCK
            lo = split * chunk
            hi = tl.minimum(lo + chunk, seq_len)
            holds_last = (last >= lo) & (last < hi)  # only the split that reads the last position writes it
        if WRITE:  # the row's new key/value go to its last position here, not in two copy kernels before the call
            if holds_last:
                _store_new_kv(k_ptr, v_ptr, table_ptr, kn_ptr, vn_ptr, kw_ptr, cos_ptr, sin_ptr, eps, row, kv_head,
                              last, stride_kblock, stride_kt, stride_kh, stride_tb, stride_knb, stride_knh,
                              stride_vnb, stride_vnh, stride_cb, D, PAGE, HEADS)
        g_ok = g < GROUP
        heads = kv_head * GROUP + g
        q_offs = row * stride_qb + heads[:, None] * stride_qh + d[None, :]
        if HEADS:  # [G, D] in the cache's dtype, as the eager head math rounds it
            q = _head_norm_rope(q_ptr, q_offs, d[None, :], qw_ptr, cos_ptr + row * stride_cb, sin_ptr + row * stride_cb,
                                eps, g_ok[:, None], D)
        else:
            q = tl.load(q_ptr + q_offs, mask=g_ok[:, None], other=0.0)
        if not TENSOR_CORES:
            q = q.to(tl.float32)
        m = tl.full([GROUP_P], float("-inf"), tl.float32)
        l_sum = tl.zeros([GROUP_P], tl.float32)
        acc = tl.zeros([GROUP_P, D], tl.float32)
        for start in range(lo, hi, BLOCK):
            n = start + tl.arange(0, BLOCK)
            n_ok = n < hi
            block = tl.load(table_ptr + row * stride_tb + n // PAGE, mask=n_ok, other=0)
            offs = (block * stride_kblock + (n % PAGE) * stride_kt)[:, None] + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + offs, mask=n_ok[:, None], other=0.0)  # [N, D]
            if not TENSOR_CORES:
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            elif IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(n_ok[None, :], s * sm_scale, float("-inf"))  # [G, N]
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + offs, mask=n_ok[:, None], other=0.0).to(tl.float32)  # [N, D]
            if not TENSOR_CORES:
                pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            elif IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v, input_precision="tf32")
            acc = acc * alpha[:, None] + pv
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            m = m_new
        if SPLITS == 1:
            out = acc / l_sum[:, None]
            tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
        else:  # unnormalized partials; `_combine_splits_kernel` merges a row's splits (an empty one: m = -inf)
            part = (row * tl.num_programs(1) * GROUP + heads) * SPLITS + split  # [G]: [B, H, SPLITS] index
            tl.store(part_ptr + part[:, None] * D + d[None, :], acc, mask=g_ok[:, None])
            tl.store(ml_ptr + part * 2, m, mask=g_ok)
            tl.store(ml_ptr + part * 2 + 1, l_sum, mask=g_ok)

    @triton.jit
    def _combine_splits_kernel(part_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, SPLITS: tl.constexpr, D: tl.constexpr,
                               PDL: tl.constexpr = False):
        """One (row, head): softmax-weighted merge of its SPLITS partial results (acc, running max m, sum l)."""
        if PDL:
            pdl.begin()
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        part = (row * tl.num_programs(1) + head) * SPLITS + s  # [SPLITS]
        m = tl.load(ml_ptr + part * 2)
        l_sum = tl.load(ml_ptr + part * 2 + 1)
        acc = tl.load(part_ptr + part[:, None] * D + tl.arange(0, D)[None, :])  # [SPLITS, D]
        w = tl.exp(m - tl.max(m, axis=0))  # an empty split: exp(-inf) = 0
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l_sum * w, axis=0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_pool: torch.Tensor,  # [tokens, n_kv, D] (one layer)
    v_pool: torch.Tensor,
    block_table: torch.Tensor,  # [B, blocks_per_seq] int64
    seq_lens: torch.Tensor,  # [B] int64, >= 1
    block_size: int,
    tiling: DecodeTiling | None = None,  # None: by the batch (decode_tiling)
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, n_kv, D] each: stored at position seq_lens - 1
    head_norm: HeadNorm | None = None,  # q and the new key as projected: the kernel norms and rotates them (new_kv)
    splits: int = 1,  # programs per (row, KV head), each over a share of the keys, then merged (`decode_splits`)
    pdl: bool = False,  # programmatic dependent launch (sm_90+): launched while the previous kernel ends
) -> torch.Tensor:
    """-> [B, H, D]: softmax(q k^T / sqrt(D)) v over each row's first seq_lens[row] keys.

    With `new_kv`, the kernel first stores each row's new key/value at its last position (seq_lens - 1), which
    the caller would otherwise do with two copy kernels per layer. With `head_norm`, q and the new key are the
    projections before the head norm and RoPE, which the kernel applies (the key as stored is the rotated one).

    Tiling (`decode_tiling`; `python -m bench.kernels.paged_attention` sweeps it): on tensor cores at every batch,
    where the CUDA-core kernel (one warp per program, 16 keys per iteration, its best) moved less than 3.2 TB/s
    from 256 rows up: from 64 rows up 64 keys per iteration, 2 warps, 3 tiles fetched ahead; below, 32 keys and 4
    warps, the keys of a few rows split over more programs (figures: docs/benchmarks.md, "The Aligner's stall
    gone; decode attention on tensor cores").

    With `splits` > 1 (a power of two) each (row, KV head) is `splits` programs over consecutive whole tiles of
    its keys, writing unnormalized partials that a second kernel merges ("flash decoding"): at a few rows the
    grid is rows x KV heads = 8 programs for batch 1 on a GPU with 132 SMs, each walking every key in turn.
    The split that holds the last position stores the new key/value; a split past the row's keys is empty.
    Same math, another summation order: fp32 equal to ~1e-7, not bit for bit."""
    assert splits >= 1 and splits & (splits - 1) == 0, splits
    tiling = tiling or decode_tiling(q.shape[0])
    b, n_heads, d = q.shape
    n_kv = k_pool.shape[1]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    assert k_pool.stride(2) == 1 and q.stride(2) == 1 and block_table.stride(1) == 1
    kn, vn, new_strides = _new_kv_args(new_kv, q)
    assert head_norm is None or new_kv is not None
    *head_ptrs, eps, stride_cb = _head_args(head_norm, q)
    if splits > 1:  # [B, H, splits, D] partial sums and [B, H, splits, (max, sum)], fp32
        part = torch.empty(b, n_heads, splits, d, device=q.device, dtype=torch.float32)
        ml = torch.empty(b, n_heads, splits, 2, device=q.device, dtype=torch.float32)
    else:
        part = ml = q  # never read
    args = (q, k_pool, v_pool, out, block_table, seq_lens, kn, vn, d ** -0.5, *head_ptrs, eps, part, ml,
            q.stride(0), q.stride(1), block_size * k_pool.stride(0), k_pool.stride(0), k_pool.stride(1),
            block_table.stride(0), 1, out.stride(0), out.stride(1), *new_strides, stride_cb)
    shared = dict(GROUP=group, D=d, BLOCK=tiling.keys, PAGE=block_size, WRITE=new_kv is not None,
                  HEADS=head_norm is not None, SPLITS=splits, PDL=pdl, num_warps=tiling.warps,
                  num_stages=tiling.stages, **launch_args(pdl))
    _paged_decode_kernel[(b, n_kv, splits)](*args, **shared, **_kernel_choice(tiling, group, q.dtype, d))
    if splits > 1:
        _combine_splits_kernel[(b, n_heads)](part, ml, out, out.stride(0), out.stride(1), SPLITS=splits, D=d, PDL=pdl,
                                             num_warps=1, **launch_args(pdl))
    return out


def _kernel_choice(tiling: DecodeTiling, group: int, dtype: torch.dtype, head_dim: int) -> dict:
    """The kernel's constexprs for `tiling`: on tensor cores a 16-row q tile (IEEE products for fp32 caches). A
    tensor-core product needs >= 16 along its reduced axis, so heads narrower than 16 (test-size models: the tiny
    code predictor's 8) run on CUDA cores whatever the tiling says."""
    if tiling.tensor_cores and head_dim >= 16:
        assert group <= 16, group
        return dict(GROUP_P=16, TENSOR_CORES=True, IEEE=dtype == torch.float32)
    return dict(GROUP_P=max(2, triton.next_power_of_2(group)))


def decode_splits(rows: int, n_kv: int, programs: int = 128) -> int:
    """`paged_decode_attention`'s splits for `attention_splits`: enough for about `programs` programs (one per
    SM of an H100) when rows x KV heads alone are fewer; 1 from there up. A power of two, at most 16."""
    splits = 1
    while rows * n_kv * splits < programs and splits < 16:
        splits *= 2
    return splits


def decode_tiling(rows: int) -> DecodeTiling:
    """`paged_decode_attention`'s tiling for a batch of `rows` (its docstring says why)."""
    return DecodeTiling(64, 2, 3, tensor_cores=True) if rows >= 64 else DecodeTiling(32, 4, 2, tensor_cores=True)


def _new_kv_args(new_kv: tuple[torch.Tensor, torch.Tensor] | None, q: torch.Tensor) -> tuple:
    """The kernel's new-key/value pointers and their row/head strides (q in their place when there are none)."""
    if new_kv is None:
        return q, q, (0, 0, 0, 0)
    kn, vn = new_kv
    assert kn.stride(2) == 1 and vn.stride(2) == 1
    return kn, vn, (kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1))


def contiguous_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, n_kv, L, D] (one layer; rows' keys at positions 0..L-1)
    v: torch.Tensor,
    rows: torch.Tensor,  # [B, 1] int64: arange(B), each row its own block
    seq_len: torch.Tensor,  # [1] int64: keys every row attends to (the same for all rows)
    tiling: DecodeTiling | None = None,  # warps, stages and kernel (its keys per iteration: by L); None: by the batch
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # [B, n_kv, D] each: stored at position seq_len - 1
    head_norm: HeadNorm | None = None,  # as in paged_decode_attention, for this call's position (HeadNorm.at)
    pdl: bool = False,  # as in paged_decode_attention
) -> torch.Tensor:
    """-> [B, H, D]: softmax(q k^T / sqrt(D)) v over the first seq_len keys of each row (with `new_kv`, stored
    first at position seq_len - 1, and `head_norm`, as in `paged_decode_attention`)."""
    tiling = tiling or contiguous_tiling(q.shape[0])
    b, n_heads, d = q.shape
    n_kv, length = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    out = torch.empty_like(q)
    assert k.stride(3) == 1 and q.stride(2) == 1 and k.stride() == v.stride()
    kn, vn, new_strides = _new_kv_args(new_kv, q)
    assert head_norm is None or new_kv is not None
    *head_ptrs, eps, stride_cb = _head_args(head_norm, q)
    args = (q, k, v, out, rows, seq_len, kn, vn, d ** -0.5, *head_ptrs, eps, q, q,
            q.stride(0), q.stride(1), k.stride(0), k.stride(2), k.stride(1), rows.stride(0), 0,
            out.stride(0), out.stride(1), *new_strides, stride_cb)
    shared = dict(GROUP=group, D=d, BLOCK=min(32, max(16, triton.next_power_of_2(length))), PAGE=length,
                  WRITE=new_kv is not None, HEADS=head_norm is not None, PDL=pdl, num_warps=tiling.warps,
                  num_stages=tiling.stages, **launch_args(pdl))
    _paged_decode_kernel[(b, n_kv)](*args, **shared, **_kernel_choice(tiling, group, q.dtype, d))
    return out


def contiguous_tiling(rows: int) -> DecodeTiling:
    """`contiguous_decode_attention`'s tiling for a batch of `rows` (<= 16 keys a row): from 64 rows up on CUDA
    cores, one warp per program (many small programs keep the most loads in flight); below, where a call is its
    launch and one load's latency, on tensor cores with four warps (figures: docs/benchmarks.md, "The Aligner's
    stall gone; decode attention on tensor cores")."""
    return DecodeTiling(16, 1) if rows >= 64 else DecodeTiling(16, 4, tensor_cores=True)
