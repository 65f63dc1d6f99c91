"""The batch-invariant GEMM (stages/invariant_matmul.py) on CUDA: close to an fp32 reference, rows bit-identical
across row counts and positions, and `enable()` routing eager, torch.compile'd and CUDA-graphed products to it.

Marked `gpu`: they run on the GPU machine (`python -m pytest -m gpu tests/stages`), CPU CI skips them. Speed against
cuBLAS: `python -m bench.kernels.invariant_matmul`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages import invariant_matmul as im

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# the 1.7B talker's q/k/v and down, the code predictor's down, and one no tile divides (rows 666 bytes apart:
# a slice's start is not 16-byte aligned at every row, so Triton compiles other load variants for it)
SHAPES = [(4096, 2048), (2048, 6144), (1024, 3072), (200, 333)]


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 1.6e-2), (torch.float16, 2e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n,k", SHAPES)
def test_products_match_an_fp32_reference(dtype, rtol, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w, bias = randn(gen, n, k, dtype=dtype, scale=k ** -0.5), randn(gen, n, dtype=dtype)
    for m in (1, 3, 64, 300):
        x = randn(gen, m, k, dtype=dtype)
        ref = x.float() @ w.float().t()
        for name, out, want in (("mm", im.mm(x, w.t()), ref), ("addmm", im.addmm(bias, x, w.t()), ref + bias.float()),
                                ("bmm", im.bmm(x.view(1, m, k), w.t()[None])[0], ref)):
            scale = want.abs().max().item()
            err = (out.float() - want).abs().max().item()
            print(f"{name} {dtype} {m}x{k} -> {n}: max abs err {err:.2e} (max |y| {scale:.2f})")
            assert err <= rtol * max(scale, 1.0), (name, m, err, scale)


# every swept shape (its tiles change with the row bucket: the rows must not) and the unswept one
ROW_SHAPES = sorted(im.SWEPT) + [(200, 333)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", ROW_SHAPES)
def test_rows_are_bit_identical_across_row_counts_and_positions(dtype, n, k):
    """Row counts in every bucket of `ROW_BUCKETS` (1-64, 65-128, 129-256, more) and at several positions give the
    rows of one 2048-row product, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(n * k)
    a, w, bias = randn(gen, 2048, k, dtype=dtype), randn(gen, n, k, dtype=dtype, scale=k ** -0.5), randn(gen, n,
                                                                                                       dtype=dtype)
    full, full_bias = im.mm(a, w.t()), im.addmm(bias, a, w.t())
    for m in (1, 2, 3, 8, 64, 65, 100, 128, 200, 256, 300, 512, 2048):
        for start in sorted({0, 7, 1000, 2048 - m}):
            if start + m <= 2048:
                rows = slice(start, start + m)
                assert torch.equal(im.mm(a[rows], w.t()), full[rows]), (m, start)
                assert torch.equal(im.addmm(bias, a[rows], w.t()), full_bias[rows]), (m, start)
    perm = torch.randperm(2048, generator=gen, device="cuda")
    assert torch.equal(im.mm(a[perm], w.t()), full[perm])
    assert torch.equal(im.bmm(a.view(4, 512, k), w.t().expand(4, k, n)).reshape(2048, n), full)


def test_enable_routes_eager_compiled_and_graphed_products_to_the_kernel():
    """With the switch on, F.linear / matmul / bmm (eager), a torch.compile'd F.linear with dynamic shapes (Inductor's
    extern mm/addmm calls) and a CUDA-graph replay of it give the kernel's results bit for bit at every row count;
    after the switch, aten's kernels again (cuBLAS is deterministic for one shape: the same bits as before)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = 2048, 2048
    w, bias, x = randn(gen, n, k, scale=k ** -0.5), randn(gen, n), randn(gen, 512, k)
    ref, ref_bias = im.mm(x, w.t()), im.addmm(bias, x, w.t())
    cublas = torch.mm(x, w.t())
    linear = torch.compile(lambda x_: F.linear(x_, w), dynamic=True, fullgraph=True)
    linear_bias = torch.compile(lambda x_: F.linear(x_, w, bias), dynamic=True, fullgraph=True)
    with im.invariant_matmul():
        assert torch.equal(F.linear(x, w), ref) and torch.equal(F.linear(x, w, bias), ref_bias)
        assert torch.equal(x.view(8, 64, k) @ w.t(), ref.view(8, 64, n))
        assert torch.equal(torch.bmm(x.view(8, 64, k), w.t().expand(8, k, n)), ref.view(8, 64, n))
        for m in (1, 3, 64, 300, 512):
            assert torch.equal(linear(x[:m]), ref[:m]), m
            assert torch.equal(linear_bias(x[-m:].view(1, m, k))[0], ref_bias[-m:]), m
        static = x[:64].clone()
        linear_bias(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear_bias(static)
        static.copy_(x[-64:])
        graph.replay()
        assert torch.equal(out, ref_bias[-64:])
    assert not im.enabled()
    assert torch.equal(torch.mm(x, w.t()), cublas)


# the Hopper variants the tile sweep times (stages/invariant_matmul_variants.py), on tiles() of the 4096 x 2048 product
VARIANTS = [im.Tiles(128, 64, 64, 8, 8, 4, tma=True), im.Tiles(128, 64, 64, 8, 8, 4, persistent=True),
            im.Tiles(128, 64, 64, 8, 8, 4, tma=True, persistent=True), im.Tiles(64, 32, 128, 8, 4, 3, split_k=4),
            im.Tiles(64, 32, 128, 8, 4, 3, tma=True, split_k=2)]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: f"tma{int(c.tma)}-persistent{int(c.persistent)}-split{c.split_k}")
@pytest.mark.parametrize("n,k", SHAPES)
def test_variants_are_close_and_rows_bit_identical_also_in_a_graph(cfg, n, k):
    """bf16 (K 333: TMA cannot read rows 666 bytes apart, the pointer loads run): close to fp32 at 1-2048 rows,
    rows bit-identical across row counts and positions, and the same bits replayed from a CUDA graph (the TMA
    descriptors' scratch and the split-K partials allocated during the capture)."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    a, w, bias = randn(gen, 2048, k), randn(gen, n, k, scale=k ** -0.5), randn(gen, n)
    full, full_bias = im.mm(a, w.t(), config=cfg), im.addmm(bias, a, w.t(), config=cfg)
    ref = a.float() @ w.float().t() + bias.float()
    assert (full_bias.float() - ref).abs().max().item() <= 1.6e-2 * max(ref.abs().max().item(), 1.0)
    for m in (1, 3, 64, 300, 2048):
        for start in sorted({0, 7, 2048 - m}):
            rows = slice(start, start + m)
            assert torch.equal(im.mm(a[rows], w.t(), config=cfg), full[rows]), (m, start)
            assert torch.equal(im.addmm(bias, a[rows], w.t(), config=cfg), full_bias[rows]), (m, start)
    assert torch.equal(im.bmm(a.view(4, 512, k), w.t().expand(4, k, n), config=cfg).reshape(2048, n), full)
    static = a[:64].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        im.addmm(bias, static, w.t(), config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = im.addmm(bias, static, w.t(), config=cfg)
    static.copy_(a[-64:])
    graph.replay()
    assert torch.equal(out, full_bias[-64:])


def test_a_new_specialization_counts_as_one_jit_compile():
    """stages/jit_compiles.py counts Triton's JIT compiles (the Aligner's `late_kernels`): a configuration no test
    ran before compiles once, a second launch of it compiles nothing."""
    from stages import jit_compiles

    jit_compiles.install()
    gen = torch.Generator(device="cuda").manual_seed(7)
    a, w = randn(gen, 40, 96), randn(gen, 48, 96)
    cfg = im.Tiles(32, 32, 32, 8, 2, 2)
    before = jit_compiles.compiled()
    im.mm(a, w.t(), config=cfg)
    after = jit_compiles.compiled()
    im.mm(a, w.t(), config=cfg)
    assert after == before + 1 and jit_compiles.compiled() == after
