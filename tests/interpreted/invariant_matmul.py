"""Runs under Triton's interpreter (tests/triton_interpreter.py): the batch-invariant GEMM of
stages/invariant_matmul.py in fp32 on CPU. Prints as JSON the max errors against PyTorch, whether rows are
bit-identical across row counts and positions, and what a torch.compile'd F.linear ran with the overrides registered
for the CPU key (the same aten::*.out calls Inductor emits for CUDA)."""

from __future__ import annotations

import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch
import torch.nn.functional as F

from stages import invariant_matmul as im
from stages import invariant_matmul_variants

GEN = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def products() -> dict:
    """Max |kernel - float64 reference| / max(|reference|, 1) per entry point: ragged M/N/K against the fp32 tiles
    (64 x 32 x 32), B contiguous and as a transposed weight view, A a strided slice, bias 1-D and 2-D, out=."""
    worst: dict[str, float] = {}

    def note(name: str, err: float) -> None:
        worst[name] = max(worst.get(name, 0.0), err)

    for m, n, k in ((1, 80, 200), (3, 96, 64), (70, 40, 33), (130, 96, 200)):
        a_wide = randn(m, k + 7)
        a = a_wide[:, 3:3 + k]  # rows strided k + 7 apart
        w = randn(n, k) / k ** 0.5  # nn.Linear's weight: the product takes w.t(), a transposed view
        ref = a.double() @ w.double().t()
        note("mm", rel(im.mm(a, w.t()), ref))
        note("mm", rel(im.mm(a.contiguous(), w.t().contiguous()), ref))
        bias = randn(n)
        note("addmm", rel(im.addmm(bias, a, w.t()), ref + bias.double()))
        bias2 = randn(m, n)
        note("addmm", rel(im.addmm(bias2, a, w.t()), ref + bias2.double()))
        out = torch.empty(1, 1)  # resized as aten's out= does
        note("mm.out", rel(im.mm(a, w.t(), out=out), ref))
        out = torch.empty(m, n)
        note("addmm.out", rel(im.addmm(bias, a, w.t(), out=out), ref + bias.double()))
    a, b = randn(3, 37, 50), randn(3, 40, 50).transpose(1, 2)
    note("bmm", rel(im.bmm(a, b), a.double() @ b.double()))
    out = torch.empty(3, 37, 40)
    note("bmm.out", rel(im.bmm(a, b, out=out), a.double() @ b.double()))
    note("k0", rel(im.addmm(bias[:5], randn(4, 0), randn(0, 5)), bias[:5].double().expand(4, 5)))
    return worst


def invariance() -> dict:
    """Rows computed inside products of 1, 3, 64 and 300 rows, at different positions (a block of rows at several
    offsets, all rows shuffled), against the same rows of one 300-row product: bit-identical or not, per case."""
    n, k = 96, 200  # 3 column tiles, 7 K tiles (the last ragged), 5 row tiles (the last ragged) at 300 rows
    a, w, bias = randn(300, k), randn(n, k) / k ** 0.5, randn(n)
    full, full_bias = im.mm(a, w.t()), im.addmm(bias, a, w.t())
    same = {}
    for m in (1, 3, 64, 300):
        for start in sorted({0, 5, 131, 300 - m}):
            if start + m <= 300:
                rows = slice(start, start + m)
                same[f"mm rows {start}..{start + m - 1}"] = torch.equal(im.mm(a[rows], w.t()), full[rows])
                same[f"addmm rows {start}..{start + m - 1}"] = torch.equal(im.addmm(bias, a[rows], w.t()),
                                                                           full_bias[rows])
    perm = torch.randperm(300, generator=GEN)
    same["mm shuffled"] = torch.equal(im.mm(a[perm], w.t()), full[perm])
    same["mm 300 rows within 2000"] = torch.equal(im.mm(torch.cat([randn(1700, k), a]), w.t())[1700:], full)
    batched = im.bmm(a.view(3, 100, k), w.t().expand(3, k, n))
    same["bmm entries"] = torch.equal(batched.reshape(300, n), full)
    # the check has teeth: another K tiling rounds differently (expected False)
    same["control: BLOCK_K 64"] = torch.equal(im.mm(a, w.t(), config=im.Tiles(64, 32, 64, 8, 4, 3)), full)
    return same


def compiled() -> dict:
    """torch.compile'd F.linear (dynamic shapes), with and without bias, 2-D and 3-D inputs, with the overrides
    registered for the CPU key: kernel launches per call, and whether its rows equal the eager kernel's bit for bit.
    Then the Library destroyed: no launches, aten's CPU kernel again."""
    launches = []
    launch = im._launch
    im._launch = lambda *args: (launches.append(tuple(args[0].shape)), launch(*args))[1]
    n, k = 64, 96
    a, w, bias = randn(300, k), randn(n, k) / k ** 0.5, randn(n)
    ref, ref_bias = im.mm(a, w.t()), im.addmm(bias, a, w.t())
    linear = torch.compile(lambda x, w_: F.silu(F.linear(x, w_)), dynamic=True, fullgraph=True)
    linear_bias = torch.compile(lambda x, w_, b_: F.linear(x, w_, b_) * 2, dynamic=True, fullgraph=True)
    lib = im._register("CPU")
    result = {}
    try:
        for m in (1, 7, 64, 300):
            launches.clear()
            x = a[300 - m:]
            result[f"linear {m} rows"] = (torch.equal(linear(x, w), F.silu(ref[300 - m:])), len(launches))
            launches.clear()
            y = linear_bias(x.reshape(1, m, k), w, bias)  # 3-D: Inductor folds the leading dims into M
            result[f"linear+bias {m} rows"] = (torch.equal(y[0], ref_bias[300 - m:] * 2), len(launches))
    finally:
        lib._destroy()
    launches.clear()
    y = linear_bias(a[:9].reshape(1, 9, k), w, bias)
    torch.testing.assert_close(y[0], ref_bias[:9] * 2, rtol=1e-5, atol=1e-5)
    result["after destroy"] = (True, len(launches))
    return result


VARIANTS = {  # the fp32 tiles (64 x 32 x 32) with each Hopper variant of stages/invariant_matmul_variants.py
    "tma": im.Tiles(64, 32, 32, 8, 4, 3, tma=True),
    "persistent": im.Tiles(64, 32, 32, 8, 4, 3, persistent=True),
    "tma persistent": im.Tiles(64, 32, 32, 8, 4, 3, tma=True, persistent=True),
    "split3": im.Tiles(64, 32, 32, 8, 4, 3, split_k=3),
    "tma split2": im.Tiles(64, 32, 32, 8, 4, 3, tma=True, split_k=2),
}


def variants() -> dict:
    """Per variant (K 200: 7 BLOCK_K tiles; split 3: chunks of 3, 3 and 1 tiles; persistent: 3 programs walking
    the tiles): max relative error against float64 of mm with weight.t() (TMA: K-major descriptors) and with a
    contiguous B (N-major), addmm with a 1-D bias, bmm (and a broadcast weight), out=, and an A column slice that
    TMA cannot read; whether rows are bit-identical across 1, 3, 64 and 300 rows at several positions, shuffled
    and within 2000 rows; the TMA flag of each launch of the first products (aligned, then the column slice)."""
    launches: list[bool] = []
    kernel = invariant_matmul_variants._variant_kernel

    class Spy:  # records each launch's TMA flag
        def __getitem__(self, grid):
            run = kernel[grid]
            return lambda *args, **kwargs: (launches.append(kwargs["TMA"]), run(*args, **kwargs))[1]

    invariant_matmul_variants._variant_kernel = Spy()
    n, k = 96, 200
    a, w, bias = randn(300, k), randn(n, k) / k ** 0.5, randn(n)
    ref = a.double() @ w.double().t()
    a_wide = randn(300, k + 3)
    a_slice = a_wide[:, 3:]  # starts 12 bytes in: not 16-byte aligned
    slice_ref = a_slice.double() @ w.double().t()
    batched_a, batched_b = randn(3, 37, 64), randn(3, 40, 64).transpose(1, 2)
    result = {"errors": {}, "invariance": {}, "tma_launches": {}}
    try:
        for name, cfg in VARIANTS.items():
            launches.clear()
            full = im.mm(a, w.t(), config=cfg)
            errors = {"mm": rel(full, ref)}
            im.mm(a_slice, w.t(), config=cfg)
            result["tma_launches"][name] = list(launches)
            errors["mm column slice"] = rel(im.mm(a_slice, w.t(), config=cfg), slice_ref)
            errors["mm contiguous B"] = rel(im.mm(a[:70], w.t().contiguous(), config=cfg), ref[:70])
            full_bias = im.addmm(bias, a, w.t(), config=cfg)
            errors["addmm"] = rel(full_bias, ref + bias.double())
            errors["addmm.out"] = rel(im.addmm(bias, a[:5], w.t(), out=torch.empty(1, 1), config=cfg),
                                      ref[:5] + bias.double())
            errors["bmm"] = rel(im.bmm(batched_a, batched_b, config=cfg), batched_a.double() @ batched_b.double())
            result["errors"][name] = errors
            same = {}
            for m in (1, 3, 64, 300):
                for start in sorted({0, 131, 300 - m}):
                    if start + m <= 300:
                        rows = slice(start, start + m)
                        same[f"mm rows {start}..{start + m - 1}"] = torch.equal(im.mm(a[rows], w.t(), config=cfg),
                                                                                full[rows])
                        same[f"addmm rows {start}..{start + m - 1}"] = torch.equal(
                            im.addmm(bias, a[rows], w.t(), config=cfg), full_bias[rows])
            perm = torch.randperm(300, generator=GEN)
            same["mm shuffled"] = torch.equal(im.mm(a[perm], w.t(), config=cfg), full[perm])
            same["mm 300 rows within 2000"] = torch.equal(im.mm(torch.cat([randn(1700, k), a]), w.t(), config=cfg)
                                                          [1700:], full)
            same["bmm entries"] = torch.equal(im.bmm(a.view(3, 100, k), w.t().expand(3, k, n), config=cfg)
                                              .reshape(300, n), full)
            result["invariance"][name] = same
        # teeth: split-K sums the K tiles in another order than the one-chunk kernel (expected False), TMA loads
        # the same numbers as pointer loads (expected True)
        plain = im.mm(a, w.t(), config=im.Tiles(64, 32, 32, 8, 4, 3))
        result["split3 equals one chunk"] = torch.equal(im.mm(a, w.t(), config=VARIANTS["split3"]), plain)
        result["tma equals pointer loads"] = torch.equal(im.mm(a, w.t(), config=VARIANTS["tma"]), plain)
    finally:
        invariant_matmul_variants._variant_kernel = kernel
    return result


if __name__ == "__main__":
    print(json.dumps({"products": products(), "invariance": invariance(), "compiled": compiled(),
                      "variants": variants()}))
