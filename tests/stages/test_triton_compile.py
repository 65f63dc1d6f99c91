
"""The decode path's Triton kernels compile for the H100 (sm_90), in every variant the engine launches, without
register spills and with vectorized loads: Triton's compiler and ptxas run on CPU in the Triton venv
(tests/triton_interpreter.py, tests/interpreted/compile_sm90.py). What they compute is checked by the
interpreter tests beside this one."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores


@pytest.fixture(scope="module")
def compiled() -> dict:
    return run_interpreted("compile_sm90.py", interpret=False)


def test_decode_kernels_compile_for_sm90_without_spills(compiled):
    result = {group: compiled[group] for group in ("gemv", "attention", "sampling")}
    # 10 products (8 layer products, the head, the input projection) x (4 row counts + 1 row with PDL); 4
    # attention tilings x 3 (plain, new-K/V store, + head prologue) + split kernel and merge at
    # 2 and 16 splits and at 16 with PDL, + PDL without splits (no merge); 2 vocab sizes x (plain, PDL)
    assert [len(result[k]) for k in ("gemv", "attention", "sampling")] == [50, 19, 4]
    for group, variants in result.items():
        for name, (registers, spill_bytes, vector_loads) in variants.items():
            assert 0 < registers <= 255 and spill_bytes == 0, (group, name, registers, spill_bytes)
            # with the launcher's 16-byte alignment facts, weights and K/V are read in 8-16 byte loads
            assert vector_loads > 0, (group, name)


def test_invariant_matmul_compiles_for_sm90_without_spills(compiled):
    """Every tile configuration `invariant_matmul.tiles` picks for the 1.7B/0.6B products, per dtype, as nn.Linear
    launches it (B = weight.t(), bias) and with a contiguous B: no spills, and bf16/fp16 on the tensor cores
    (wgmma; fp32 runs IEEE FMAs)."""
    result = compiled["matmul"]
    # 5 tile configurations (64x32x128, 64x64x128, 64x64x64, 128x64x64, 128x128x64) for bf16 and fp16, 2 for fp32
    # (BLOCK_N 32 and 64), x 2 layouts
    assert len(result) == 24
    for name, (registers, spill_bytes, wgmma) in result.items():
        assert 0 < registers <= 255 and spill_bytes == 0, (name, registers, spill_bytes)
        assert (wgmma > 0) == (not name.startswith("fp32")), (name, wgmma)


def test_invariant_matmul_sweep_candidates_compile_for_sm90_without_spills(compiled):
    """Per variant form the tile sweep times (bench.kernels.invariant_matmul.candidates: TMA loads through
    device-side descriptors, persistent programs, split-K with its in-order sum), its largest candidate, bf16 as
    nn.Linear launches it, plus a contiguous-B TMA form with bias and an fp32 one: no spills, wgmma on bf16, TMA
    copies (cp.async.bulk.tensor) exactly in the TMA variants, and the sum kernel's loads vectorized."""
    result = compiled["matmul_variants"]
    # 7 forms (TMA, persistent, both; split 2 and 4, each with and without TMA), 2 extra TMA forms, 2 splits x bias
    assert len(result) == 7 + 2 + 4
    for name, (registers, spill_bytes, *counts) in result.items():
        assert 0 < registers <= 255 and spill_bytes == 0, (name, registers, spill_bytes)
        if name.startswith("sum"):
            assert counts[0] > 0, (name, counts)  # 16-byte loads of the fp32 partials
            continue
        assert (counts[0] > 0) == name.startswith("bf16"), (name, counts)  # wgmma
        assert (counts[1] > 0) == (" tma" in name), (name, counts)  # TMA copies only where asked
