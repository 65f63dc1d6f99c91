"""The batch-invariant GEMM (stages/invariant_matmul.py) on CPU: what the Triton kernel computes and that rows are
bit-identical across row counts and positions, under Triton's interpreter (tests/triton_interpreter.py), and the
switch that routes aten's mm/addmm/bmm to it on CUDA. On CUDA (bf16, the Talker's shapes, torch.compile and CUDA
graphs): tests/stages/gpu/test_invariant_matmul_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages import invariant_matmul
from tests.triton_interpreter import run_interpreted

OPS = ("aten::mm", "aten::mm.out", "aten::addmm", "aten::addmm.out", "aten::bmm", "aten::bmm.out")


def overridden() -> list[bool]:
    """Whether each op has a CUDA kernel (a CPU build has none, so only the override makes one)."""
    return [torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in OPS]


@pytest.mark.slow  # Triton interpreter and Inductor in a subprocess: ~1 min on 2 cores
def test_kernel_computes_the_product_and_rows_do_not_depend_on_the_batch():
    result = run_interpreted("invariant_matmul.py")
    assert set(result["products"]) == {"mm", "addmm", "mm.out", "addmm.out", "bmm", "bmm.out", "k0"}
    for name, err in result["products"].items():
        assert err <= 1e-6, (name, err)  # fp32, summation order only (seen: <= 1.8e-7)
    control = result["invariance"].pop("control: BLOCK_K 64")
    assert not control  # another K tiling rounds differently: bit equality is a real check here
    assert len(result["invariance"]) == 29 and all(result["invariance"].values()), result["invariance"]
    # compiled F.linear (dynamic shapes; 2-D and 3-D inputs, with and without bias): Inductor's extern
    # mm.out / addmm.out calls went through the override, one launch per call, bit-equal to the eager kernel
    compiled = result["compiled"]
    assert compiled.pop("after destroy") == [True, 0]  # the Library destroyed: aten's CPU kernel again
    assert len(compiled) == 8 and all(v == [True, 1] for v in compiled.values()), compiled
    # the Hopper variants (TMA descriptors, persistent programs, split-K with an in-order sum): close to float64 on
    # every entry point, rows bit-identical across row counts and positions
    variants = result["variants"]
    assert set(variants["errors"]) == {"tma", "persistent", "tma persistent", "split3", "tma split2"}
    for name, errors in variants["errors"].items():
        assert len(errors) == 6 and max(errors.values()) <= 1e-6, (name, errors)
    for name, same in variants["invariance"].items():
        assert len(same) == 23 and all(same.values()), (name, same)
    # TMA where asked and the operands allow (16-byte aligned), pointer loads for an A column slice that is not
    assert variants["tma_launches"] == {"tma": [True, False], "persistent": [False, False],
                                        "tma persistent": [True, False], "split3": [False, False],
                                        "tma split2": [True, False]}
    assert not variants["split3 equals one chunk"]  # split-K rounds differently: the equalities above have teeth
    assert variants["tma equals pointer loads"]


def test_enable_disable_are_refcounted_and_leave_cpu_tensors_alone():
    gen = torch.Generator().manual_seed(0)
    a, w, bias = torch.randn(5, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.randn(8, generator=gen)
    batched = torch.randn(3, 5, 16, generator=gen)

    def cpu_results() -> list[torch.Tensor]:
        return [torch.mm(a, w.t()), F.linear(a, w, bias), torch.bmm(batched, w.t().expand(3, 16, 8)), a @ w.t()]

    before, baseline = overridden(), cpu_results()
    assert not any(before) and not invariant_matmul.enabled()
    invariant_matmul.enable()
    invariant_matmul.enable()
    try:
        assert all(overridden()) and invariant_matmul.enabled()
        for got, want in zip(cpu_results(), baseline, strict=True):  # the CPU key's kernels are aten's: same bits
            assert torch.equal(got, want)
        invariant_matmul.disable()
        assert all(overridden()), "one enable() still holds the override"
    finally:
        invariant_matmul.disable()
    assert overridden() == before and not invariant_matmul.enabled()
    with pytest.raises(RuntimeError, match="without a matching enable"):
        invariant_matmul.disable()
    with invariant_matmul.invariant_matmul():
        assert all(overridden())
    assert overridden() == before


def test_a_shapes_split_count_never_follows_the_row_count():
    """A row's bits follow the K order and the split count alone (stages/invariant_matmul.py, `SWEPT`), so only those
    must not depend on M: per swept shape one split count in every row bucket, and every bucket's tiles
    tensor-core sized with >= 2 column tiles; unswept shapes and fp32 take one configuration for every M."""
    for (n, k), per_bucket in invariant_matmul.SWEPT.items():
        assert len(per_bucket) == len(invariant_matmul.ROW_BUCKETS) + 1, (n, k)
        picked = {invariant_matmul.tiles(m, n, k, torch.bfloat16) for m in (1, 64, 65, 128, 129, 256, 257, 8192)}
        assert picked == set(per_bucket), (n, k)
        assert len({cfg.split_k for cfg in per_bucket}) == 1, (n, k)
        for cfg in per_bucket:
            assert cfg.block_m in (64, 128) and 32 <= cfg.block_n <= 256 and -(-n // cfg.block_n) >= 2, (n, k, cfg)
            assert cfg.split_k == 1 or k // cfg.split_k >= 512, (n, k, cfg)
    for n, k, dtype in ((1536, 896, torch.bfloat16), (4096, 2048, torch.float32), (200, 333, torch.float16)):
        assert len({invariant_matmul.tiles(m, n, k, dtype) for m in (1, 100, 200, 4000)}) == 1, (n, k, dtype)
    # off Hopper (and under the interpreter) the table is not proven: a swept shape too takes one plain configuration
    for n, k in invariant_matmul.SWEPT:
        picked = {invariant_matmul.tiles(m, n, k, torch.bfloat16, sm90=False) for m in (1, 100, 200, 4000)}
        assert len(picked) == 1 and not any(c.tma or c.persistent or c.split_k > 1 for c in picked), (n, k, picked)


def test_split_k_is_at_least_one_and_not_persistent():
    with pytest.raises(ValueError, match="split_k"):
        invariant_matmul.Tiles(64, 64, 64, 8, 4, 3, split_k=0)
    with pytest.raises(ValueError, match="split_k"):
        invariant_matmul.Tiles(64, 64, 64, 8, 4, 3, persistent=True, split_k=2)


def test_addmm_other_than_beta_alpha_one_is_refused():
    with pytest.raises(NotImplementedError, match="beta=1, alpha=1"):
        invariant_matmul.addmm(torch.zeros(2), torch.zeros(2, 3), torch.zeros(3, 2), beta=0.5)
