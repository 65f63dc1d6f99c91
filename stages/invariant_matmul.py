"""A batch-invariant GEMM: every output row is computed the same way whatever the row count and the row's position.

cuBLAS picks its kernel (tile, split-K) from M, so a row's rounding depends on how many rows share the product; that
is why deterministic mode fixes shapes (docs/talker_engine.md, "Deterministic mode"). Here the tile configuration is
a function of (N, K, dtype) and M's bucket only (`tiles`; `SWEPT` says why M may pick tiles), split-K (where used)
is fixed per (N, K) and summed in order, and the K loop runs in one fixed order: an output element is the fp32 sum
of the same k16 MMA steps, in the same order, whether its row sits alone or at row 217 of 3000. Rows past M are
masked loads (zeros) that no valid row reads. Bias (addmm) is added to the fp32 accumulator before the one rounding
to the output dtype, as cuBLAS's epilogue does. fp32 runs in IEEE precision (no TF32, as torch.mm by default).
`Tiles` can also select Hopper variants (TMA loads, persistent programs, a split-K fixed per (N, K) summed in order:
stages/invariant_matmul_variants.py), invariant by the same construction; `tiles()` takes them where the sweep
found them faster, on sm_90.

`enable()` / `disable()` (refcounted; `invariant_matmul()` is both as a context manager) register these kernels as
the CUDA implementations of aten::mm, mm.out, addmm, addmm.out, bmm and bmm.out (a `torch.library.Library("aten",
"IMPL")`; disable destroys it, which restores aten's kernels). What that covers:
- eager F.linear / torch.matmul / @ on CUDA (they decompose to mm, addmm or bmm);
- torch.compile'd code: without max-autotune (the project never sets it) Inductor emits its products as
  `extern_kernels.mm(..., out=buf)` / `addmm` / `bmm`, Python calls of torch.mm & co. that go through the
  dispatcher to the .out overloads at run time (and so inside CUDA-graph captures of it); checked on CPU with these
  kernels registered for the CPU key (tests/interpreted/invariant_matmul.py) and on CUDA by
  tests/stages/gpu/test_invariant_matmul_gpu.py. Kernels compiled before `enable()` take it too: the lookup is at
  every call. A CUDA graph captured before `enable()` keeps the cuBLAS kernels it recorded.
Not covered: Inductor's own Triton mm templates (max-autotune only) and `native_matmul`; Inductor's `cpp_wrapper` and
AOTInductor (their C shims call aten's CUDA kernels directly, not through the dispatcher); aten ops other than the six
(mv, addmv, baddbmm, addbmm, dot, the out_dtype overloads, _scaled_mm, _int_mm); attention (SDPA and the project's
attention kernels are per-row kernels, not these products). Other dtypes (fp64, complex) go to cuBLAS through
aten::baddbmm (not invariant); addmm with beta or alpha other than 1 raises. CPU tensors never reach the override
(it is registered for the CUDA key only), so nothing recurses into it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from stages import invariant_matmul_variants
from stages.aten_override import AtenOverride

try:
    import triton
    import triton.language as tl

    from stages.invariant_matmul_variants import grouped_tile, output_tile
except ImportError:  # CPU-only installs: nothing to register a CUDA kernel for
    triton = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_GRID_Y = 65535  # batch entries per launch (CUDA's grid y limit)


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row tiles that walk the column tiles together (prefill: a weight tile is read while in L2)
    num_warps: int
    num_stages: int
    # Hopper variants (stages/invariant_matmul_variants.py), where `SWEPT` takes them; the defaults: the kernel below
    tma: bool = False  # operand tiles through TMA (device-side tensor descriptors)
    persistent: bool = False  # one program per SM, each walking tiles in a fixed order
    split_k: int = 1  # K cut in this many chunks (fixed per (N, K)), fp32 partials summed in order by a 2nd kernel

    def __post_init__(self) -> None:
        granule = invariant_matmul_variants.SPLIT_GRANULE
        if self.split_k < 1 or self.split_k > 1 and (self.persistent or granule % self.block_k):
            raise ValueError(f"Tiles: split_k must be >= 1, and split-K is not persistent and its BLOCK_K divides "
                             f"{granule} (got {self})")


ROW_BUCKETS = (64, 128, 256)  # a swept shape's tiles per row count: <= 64, <= 128, <= 256, more (prefill included)


def _t(bm: int, bn: int, bk: int, warps: int, stages: int, **variant) -> Tiles:
    return Tiles(bm, bn, bk, 8, warps, stages, **variant)


# The H200 sweep's fastest tiles per (N, K) of the 1.7B products and per row bucket, bf16/fp16, within the split count
# fixed for that (N, K) (`python -m bench.kernels.invariant_matmul --sweep --tiles-table`; docs/benchmarks.md has the
# run). Why tiles may follow the row count at all: on sm_90 a row's bits depend only on the K order (BLOCK_K-tile
# by BLOCK_K-tile k16 MMA steps into an fp32 accumulator) and the split count, not on BLOCK_M/N/K, warps, stages,
# TMA or a persistent grid: the sweep found every configuration of one split count bit-identical on every product,
# and rejects a table that breaks this; tests/stages/gpu/test_invariant_matmul_gpu.py checks the rows across buckets.
# Split counts: 4 where K is deep for few column tiles (the Talker's down projection, the code predictor's 2048- and
# 3072-deep products), 1 elsewhere.
SWEPT: dict[tuple[int, int], tuple[Tiles, Tiles, Tiles, Tiles]] = {
    (1024, 2048): (_t(64, 32, 128, 4, 3, split_k=4), _t(64, 32, 128, 4, 3, split_k=4), _t(64, 64, 64, 4, 4, split_k=4),
                   _t(64, 128, 64, 4, 4, split_k=4)),
    (1024, 3072): (_t(64, 32, 128, 4, 3, split_k=4), _t(64, 64, 128, 4, 3, split_k=4), _t(64, 64, 128, 4, 3, split_k=4),
                   _t(64, 128, 64, 4, 4, tma=True, split_k=4)),
    (2048, 1024): (_t(64, 32, 128, 4, 3), _t(64, 32, 128, 4, 3), _t(64, 64, 128, 4, 3), _t(128, 64, 128, 8, 3)),
    (2048, 2048): (_t(64, 32, 128, 4, 3), _t(64, 32, 128, 4, 3), _t(64, 64, 128, 4, 3),
                   _t(64, 128, 128, 4, 3, tma=True)),
    (2048, 6144): (_t(64, 32, 128, 4, 3, split_k=4), _t(64, 64, 128, 4, 3, split_k=4), _t(64, 128, 64, 4, 4, split_k=4),
                   _t(128, 256, 64, 8, 4, split_k=4)),
    (3072, 2048): (_t(64, 32, 128, 4, 3), _t(64, 32, 128, 4, 3), _t(64, 64, 128, 4, 3, tma=True),
                   _t(64, 128, 64, 4, 4, tma=True)),
    (4096, 1024): (_t(64, 32, 128, 4, 3), _t(64, 32, 128, 4, 3), _t(128, 64, 128, 8, 3), _t(64, 256, 64, 4, 4, tma=True)),
    (4096, 2048): (_t(64, 32, 128, 4, 3), _t(64, 32, 128, 4, 3), _t(64, 64, 128, 4, 3, tma=True),
                   _t(64, 256, 64, 4, 4, tma=True)),
    (6144, 1024): (_t(64, 64, 128, 4, 3), _t(64, 32, 128, 4, 3), _t(64, 128, 64, 4, 4, tma=True),
                   _t(128, 256, 64, 8, 4, tma=True)),
    (12288, 2048): (_t(64, 32, 128, 4, 3), _t(64, 64, 64, 4, 4), _t(128, 256, 64, 8, 4, tma=True),
                    _t(128, 128, 64, 8, 4, tma=True, persistent=True)),
}


def tiles(m: int, n: int, k: int, dtype: torch.dtype, sm90: bool = True) -> Tiles:
    """The tile configuration of an [M, K] x [K, N] product. Its split count (the one thing that sets a row's bits,
    see `SWEPT`) is a function of (N, K, dtype) only; the tiles of a swept shape follow M's bucket (`ROW_BUCKETS`).

    `sm90`: the product runs on a Hopper GPU, where `SWEPT` was measured and its bits proven tile-independent (the
    launcher passes what it runs on; the table's tests ask for it on any machine). Elsewhere, and under Triton's
    interpreter, swept shapes follow the rules below as every other shape does.
    bf16 and fp16 products of a swept shape on sm_90 take `SWEPT`; other shapes (the 0.6B's, tests) one configuration
    for every M, a rule fitted to an earlier sweep: wide products (N >= 8192) 128 x 128 tiles on two warpgroups; N 4096 at
    K 2048 128 x 64; K 1024 BLOCK_K 64; N <= 1024 BLOCK_N 32 (enough programs at few rows); the rest 64 x 64 x 128.
    fp32 (IEEE: FMAs, not tensor cores; tests and references, not the Talker's bf16 path) uses shorter tiles, and
    Triton's interpreter (CPU tests) sums a BLOCK_K tile at once, so there BLOCK_K would change the bits: neither
    follows M. tests/interpreted/compile_sm90.py checks that each configuration this returns compiles for sm_90
    without spills.
    """
    if dtype == torch.float32:
        return Tiles(64, 32 if n <= 1024 else 64, 32, 8, 4, 3)
    if sm90 and (n, k) in SWEPT:
        return SWEPT[(n, k)][sum(m > top for top in ROW_BUCKETS)]
    if n >= 8192:
        return Tiles(128, 128, 64, 8, 8, 3)
    if n >= 4096 and k >= 2048:
        return Tiles(128, 64, 64, 8, 8, 4)
    if k <= 1024 and n >= 3072:
        return Tiles(64, 64, 64, 8, 4, 4)
    if n <= 1024:
        return Tiles(64, 32, 128, 8, 4, 3)
    return Tiles(64, 64, 128, 8, 4, 3)


if triton is not None:

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 / M % 16 variants)
    def _matmul_kernel(
        a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
        stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
        stride_biasm, stride_biasn,
        BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        # one tile of this batch entry: the variants' tile with pointer loads over the whole K (no split-K), in the
        # grouped order (which program computes a tile changes nothing in what it computes)
        batch = tl.program_id(1).to(tl.int64)
        pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        output_tile(a_ptr + batch * stride_ab, b_ptr + batch * stride_bb, c_ptr + batch * stride_cb, bias_ptr, pid_m,
                    pid_n, M, N, 0, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_biasm,
                    stride_biasn, BIAS, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, False, False, False)


@functools.cache
def _is_sm90(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
            config: Tiles | None) -> torch.Tensor:
    """out[i] = a[i] @ b[i] (+ bias, [M, N]-broadcast) for 3-D a [B, M, K], b [B, K, N], out [B, M, N]."""
    batch, m, k = a.shape
    n = b.shape[2]
    if out.numel() == 0:
        return out
    if k == 0:  # an empty sum: nothing to launch over
        return out.copy_(bias.expand(out.shape)) if bias is not None else out.zero_()
    if triton is None:
        raise RuntimeError("the invariant matmul needs Triton")
    cfg = config or tiles(m, n, k, a.dtype, sm90=a.is_cuda and _is_sm90(a.device.index))
    bias_strides = bias.stride() if bias is not None else (0, 0)
    with invariant_matmul_variants.on_device(a):
        if cfg.tma or cfg.persistent or cfg.split_k > 1:
            return invariant_matmul_variants.launch(a, b, out, bias, cfg)
        for b0 in range(0, batch, MAX_GRID_Y):
            a_, b_, out_ = a[b0:b0 + MAX_GRID_Y], b[b0:b0 + MAX_GRID_Y], out[b0:b0 + MAX_GRID_Y]
            grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), a_.shape[0])
            _matmul_kernel[grid](
                a_, b_, out_, bias if bias is not None else out_, m, n, k, *a_.stride(), *b_.stride(), *out_.stride(),
                *bias_strides, BIAS=bias is not None, IEEE=a.dtype == torch.float32, BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages,
            )
    return out


def _checked(a: torch.Tensor, b: torch.Tensor, dims: int, name: str) -> None:
    if a.dim() != dims or b.dim() != dims:
        raise RuntimeError(f"{name}: expected {dims}-D tensors, got {a.dim()}-D and {b.dim()}-D")
    if a.shape[-1] != b.shape[-2] or (dims == 3 and a.shape[0] != b.shape[0]):
        raise RuntimeError(f"{name}: shapes cannot be multiplied ({tuple(a.shape)} and {tuple(b.shape)})")
    if a.dtype != b.dtype:
        raise RuntimeError(f"{name}: expected both operands to have the same dtype, got {a.dtype} and {b.dtype}")
    if a.device != b.device:
        raise RuntimeError(f"{name}: expected both operands on the same device, got {a.device} and {b.device}")


def _result(out: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if out.dtype != like.dtype or out.device != like.device:
        raise RuntimeError(f"{name}: out is {out.dtype} on {out.device}, expected {like.dtype} on {like.device}")
    if tuple(out.shape) != shape:
        out.resize_(shape)
    return out


def _product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None,
             config: Tiles | None) -> torch.Tensor:
    """3-D operands (a [B, M, K], b [B, K, N], out [B, M, N], bias [M, N]-broadcast) through the kernel; dtypes it
    does not serve through aten::baddbmm (cuBLAS), which the override leaves alone: no recursion."""
    if a.dtype in DTYPES:
        return _launch(a, b, out, bias, config)
    base = bias if bias is not None else a.new_zeros(1, 1, 1)
    return out.copy_(torch.baddbmm(base, a, b, beta=1 if bias is not None else 0))


def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, config: Tiles | None = None
       ) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] in a's dtype; any strides."""
    _checked(a, b, 2, "mm")
    out = _result(out, a, (a.shape[0], b.shape[1]), "mm")
    _product(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), None, config)
    return out


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1, out: torch.Tensor | None = None,
          config: Tiles | None = None) -> torch.Tensor:
    """bias (broadcast to [M, N]) + a @ b, the sum rounded once; beta and alpha must be 1."""
    if beta != 1 or alpha != 1:
        raise NotImplementedError(f"invariant addmm: only beta=1, alpha=1 (got beta={beta}, alpha={alpha})")
    _checked(a, b, 2, "addmm")
    shape = (a.shape[0], b.shape[1])
    out = _result(out, a, shape, "addmm")
    _product(a.unsqueeze(0), b.unsqueeze(0), out.unsqueeze(0), bias.expand(shape), config)
    return out


def bmm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, config: Tiles | None = None
        ) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N]: every batch entry through the same kernel (a 2-D grid)."""
    _checked(a, b, 3, "bmm")
    out = _result(out, a, (a.shape[0], a.shape[1], b.shape[2]), "bmm")
    return _product(a, b, out, None, config)


def _register(dispatch_key: str) -> torch.library.Library:
    """A Library holding the six overrides for `dispatch_key` ("CUDA"; tests: "CPU" under Triton's interpreter)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("mm", lambda a, b: mm(a, b), dispatch_key)
    lib.impl("mm.out", lambda a, b, *, out: mm(a, b, out=out), dispatch_key)
    lib.impl("addmm", lambda bias, a, b, *, beta=1, alpha=1: addmm(bias, a, b, beta=beta, alpha=alpha), dispatch_key)
    lib.impl("addmm.out", lambda bias, a, b, *, beta=1, alpha=1, out: addmm(bias, a, b, beta=beta, alpha=alpha,
                                                                            out=out), dispatch_key)
    lib.impl("bmm", lambda a, b: bmm(a, b), dispatch_key)
    lib.impl("bmm.out", lambda a, b, *, out: bmm(a, b, out=out), dispatch_key)
    return lib


def available() -> bool:
    """Whether the kernel can run here (Triton and a CUDA device)."""
    return triton is not None and torch.cuda.is_available()


_switch = AtenOverride("invariant_matmul", lambda: [_register("CUDA")])
# Route CUDA mm/addmm/bmm (and their .out forms) through the invariant kernel from `enable()` until the matching
# `disable()` (refcounted; `invariant_matmul()` is both as a context manager)
enable, disable, enabled, invariant_matmul = _switch.enable, _switch.disable, _switch.enabled, _switch.scope
