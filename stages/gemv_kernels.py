"""A decoder layer's products for a few rows (batch 1-8 decode), as Triton GEMVs with their neighbours fused.

At batch 1 a frame is 103 layer evaluations (28 talker + 15 x 5 code predictor), each with four products. cuBLAS
runs each as its own GEMV-shaped kernel (plus a split-K reduce for some) between small fused elementwise kernels:
~10 kernels per layer, and the H100 profile of the batch-1 step (`docs/benchmarks.md`, "Fewer kernels per frame")
showed the GEMVs reading the weights at ~1 TB/s (latency-bound: 4-12 MB each) and ~1 ms of the 6.8 ms step in
kernel boundaries. Here each product is one kernel with what sits around it:

- `NORM`: the input RMSNorm (fp32 statistics, cast to the input dtype, times the norm weight: the same rounding
  points as `stages/layers._rms`) is computed by every program from the input row, which is a few KB;
- `SWIGLU`: the stacked gate/up weight gives two accumulators per output column, and `silu(gate) * up` is the
  epilogue (the MLP's intermediate never exists unactivated);
- `RESIDUAL`: the residual add is the epilogue of o_proj and down_proj;
- `BIAS`: a bias added to the fp32 product before its rounding, as F.linear's epilogue does (the code predictor's
  input projection, 2048 -> 1024 in the 1.7B model).

So a layer is norm+q/k/v, q/k norm + RoPE, attention, o_proj+residual, norm+gate/up+SwiGLU, down+residual. Each
program computes `BLOCK_N` output columns for all rows, reading its weight rows once over K (fp32 FMAs on CUDA
cores: at <= 8 rows the kernel is bound by the weight bytes, not by math); the tiling spreads a product over
hundreds of narrow programs (4-8 output columns each) so that enough loads are in flight (`bench/gemv.py` sweeps
it). The first version reduced every tile inside its K loop and waited on each load in turn: 1.0-1.4x cuBLAS's
time at its best tiling on the H100; the loop now accumulates element-wise and keeps the next tile's load in
flight (not yet measured). The eager layer stays the
reference: in fp32 the results differ from it only by summation order (GPU tests, `tests/stages/gpu/test_gemv_gpu.py`).
"""

from __future__ import annotations

import torch

from stages.pdl import launch_args

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: the layers keep their PyTorch path
    triton = None

MAX_ROWS = 8  # rows a call handles in one pass over the weights (more rows: the GEMM path is the right one)


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _weight_tile(w_ptr, n, n_ok, k, k_ok, stride_wn, up_offset, SWIGLU: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] tile of the weight rows (and, SwiGLU, of the up rows `up_offset` below them), as
        stored: converted only where it is multiplied, so a prefetched tile holds half the registers."""
        offs = n[:, None] * stride_wn + k[None, :]
        ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + offs, mask=ok, other=0.0)
        w_up = w
        if SWIGLU:
            w_up = tl.load(w_ptr + up_offset * stride_wn + offs, mask=ok, other=0.0)
        return w, w_up

    @triton.jit
    def _input_tile(x_ptr, norm_ptr, m, m_ok, k, k_ok, stride_xm, NORM: tl.constexpr):
        """One [M_P, BLOCK_K] tile of the input rows as stored (fp32) and, NORM, the norm weight's [BLOCK_K]."""
        xv = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        nw = xv
        if NORM:
            nw = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        return xv, nw

    @triton.jit
    def _normed(xv, nw, rstd, dt: tl.constexpr, NORM: tl.constexpr):
        """NORM: the input tile as `_rms` gives it (normalized in fp32, cast to the input dtype, times the weight,
        rounded to the dtype)."""
        if NORM:
            xv = (xv * rstd[:, None]).to(dt).to(tl.float32)
            xv = (xv * nw[None, :]).to(dt).to(tl.float32)
        return xv

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, bias_ptr, eps,
        M, N, up_offset, stride_xm, stride_wn, stride_om, stride_rm,
        K: tl.constexpr, M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NORM: tl.constexpr, SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, BIAS: tl.constexpr = False,
    ):
        # Why the loops look like this: Triton software-pipelines only loads that feed tl.dot, and a reduction
        # inside a loop puts a barrier in every iteration. So the products accumulate element-wise
        # ([rows, BLOCK_N, BLOCK_K] partial sums) and are reduced once after the loop; each iteration issues the
        # next tiles' loads (weights, input, norm weight) before the current tiles' FMAs, so one set is always in
        # flight; and the norm statistics' loop over the (few-KB) input is unrolled, its loads all issued at once.
        pid = tl.program_id(0)
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        m = tl.arange(0, M_P)
        m_ok = m < M
        kk = tl.arange(0, BLOCK_K)
        dt: tl.constexpr = x_ptr.dtype.element_ty  # where the eager ops round; the store converts to out's dtype
        if PDL:  # programmatic dependent launch: the next kernel may start its own weight loads now
            gdc_launch_dependents()
        # the first weight tile: weights never change, so it loads before the wait for the previous kernel
        w, w_up = _weight_tile(w_ptr, n, n_ok, kk, kk < K, stride_wn, up_offset, SWIGLU)
        if PDL:  # from here on the previous kernel's outputs (x, the residual) are complete and visible
            gdc_wait()
        rstd = tl.full([M_P], 1.0, tl.float32)
        if NORM:  # the rows' RMS statistics: every program reads the input rows once more
            ss = tl.zeros([M_P, BLOCK_K], tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):
                xs, _ = _input_tile(x_ptr, norm_ptr, m, m_ok, k0 + kk, k0 + kk < K, stride_xm, False)
                ss += xs * xs
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
        xv, nw = _input_tile(x_ptr, norm_ptr, m, m_ok, kk, kk < K, stride_xm, NORM)
        acc = tl.zeros([M_P, BLOCK_N, BLOCK_K], tl.float32)
        acc_up = tl.zeros([M_P, BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(BLOCK_K, K, BLOCK_K):  # tile k0 loads while tile k0 - BLOCK_K is multiplied
            k = k0 + kk
            w_next, w_up_next = _weight_tile(w_ptr, n, n_ok, k, k < K, stride_wn, up_offset, SWIGLU)
            xv_next, nw_next = _input_tile(x_ptr, norm_ptr, m, m_ok, k, k < K, stride_xm, NORM)
            xn = _normed(xv, nw, rstd, dt, NORM)
            acc += xn[:, None, :] * w.to(tl.float32)[None, :, :]
            if SWIGLU:
                acc_up += xn[:, None, :] * w_up.to(tl.float32)[None, :, :]
            w, w_up, xv, nw = w_next, w_up_next, xv_next, nw_next
        xn = _normed(xv, nw, rstd, dt, NORM)  # the last tile
        acc += xn[:, None, :] * w.to(tl.float32)[None, :, :]
        y = tl.sum(acc, axis=2)
        if BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y = y.to(dt).to(tl.float32)  # the product as F.linear returns it
        if SWIGLU:  # F.silu(gate) * up, each rounded to the dtype as the eager ops are
            acc_up += xn[:, None, :] * w_up.to(tl.float32)[None, :, :]
            gate_act = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)
            y = gate_act * tl.sum(acc_up, axis=2).to(dt).to(tl.float32)
        out_ok = m_ok[:, None] & n_ok[None, :]
        if RESIDUAL:
            y += tl.load(res_ptr + m[:, None] * stride_rm + n[None, :], mask=out_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y.to(dt).to(out_ptr.dtype.element_ty), mask=out_ok)


# One row (batch 1, where the GEMVs are most of a step): the H200 sweep's fastest tiling of the 1.7B model's products
# where it is not the rule's below, by (N, K, SwiGLU) (`python -m bench.kernels.gemv --rows 1 --warps 4,8`; figures:
# docs/benchmarks.md, "One-row GEMVs tiled for the H200"). Wider tiles where N is large, narrower where it is
# small (enough programs in flight), longer where K is long (fewer loop trips); the rule below was chosen on an H100.
SWEPT_ONE_ROW = {
    (4096, 2048, False): (8, 512, 4),  # talker q/k/v
    (6144, 2048, True): (16, 256, 4),  # talker gate/up
    (2048, 6144, False): (4, 1024, 4),  # talker down
    (1024, 2048, False): (2, 1024, 4),  # code predictor o
    (3072, 1024, True): (4, 128, 4),  # code predictor gate/up
    (1024, 3072, False): (4, 1024, 4),  # code predictor down
}


def tiling(m: int, n: int, k: int, swiglu: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for m rows times an [n, k] weight: at one row the sweep's where it has one
    (`SWEPT_ONE_ROW`), otherwise narrow, long tiles: 4 output rows (8 with SwiGLU) by 512 columns, so each program's
    loop runs few, large loads (`python -m bench.kernels.gemv` sweeps them; the figures: docs/benchmarks.md,
    "Few-row GEMVs on by default"). The product tile (rows x BLOCK_N x BLOCK_K, twice with SwiGLU) stays <= 8192
    values, which ptxas fits in registers without spills for sm_90 at every shape of the 1.7B and 0.6B layers
    (tests/interpreted/compile_sm90.py)."""
    if m == 1 and (n, k, swiglu) in SWEPT_ONE_ROW:
        return SWEPT_ONE_ROW[(n, k, swiglu)]
    rows = triton.next_power_of_2(m)
    block_n = 8 if swiglu else 4
    block_k = max(32, min(512, 8192 // (block_n * rows * (2 if swiglu else 1))))
    return block_n, min(block_k, triton.next_power_of_2(k)), 4


def gemv(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, unit inner stride
    weight: torch.Tensor,  # [N, K] (SwiGLU: [2 * N, K], gate rows then up rows)
    norm: tuple[torch.Tensor, float] | None = None,  # (RMSNorm weight [K], eps): normalize x first
    swiglu: bool = False,  # -> silu(x @ gate^T) * (x @ up^T), [M, N]
    residual: torch.Tensor | None = None,  # [M, N]: added to the product
    blocks: tuple[int, int, int] | None = None,  # (BLOCK_N, BLOCK_K, num_warps); None: `tiling`
    out_dtype: torch.dtype | None = None,  # e.g. fp32 logits: rounded to x's dtype first, as `linear(...).float()`
    pdl: bool = False,  # programmatic dependent launch (sm_90+): weight loads overlap the previous kernel's end
    bias: torch.Tensor | None = None,  # [N]: added before the product's rounding (not with SwiGLU)
) -> torch.Tensor:
    """-> [M, N] in x's dtype (or `out_dtype`): (RMSNorm(x) if norm) @ weight^T (+ bias), then SwiGLU and/or +
    residual."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == (m, n) and residual.stride(1) == 1
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous() and not swiglu)
    block_n, block_k, warps = blocks or tiling(m, n, k, swiglu)
    norm_w, eps = norm if norm is not None else (x, 0.0)
    res = residual if residual is not None else out
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, out, norm_w, res, bias if bias is not None else out, eps, m, n, n, x.stride(0), weight.stride(0),
        out.stride(0), res.stride(0),
        K=k, M_P=max(1, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm is not None, SWIGLU=swiglu, RESIDUAL=residual is not None, PDL=pdl, BIAS=bias is not None,
        num_warps=warps,
        **launch_args(pdl),
    )
    return out
