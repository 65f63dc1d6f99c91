
"""The decode path's Triton kernels compile for the H100 (sm_90), in every variant the engine launches, without
register spills and with vectorized loads: Triton's compiler and ptxas run on CPU in the Triton venv
(tests/triton_interpreter.py, tests/interpreted/compile_sm90.py). What they compute is checked by the
interpreter tests beside this one."""

from __future__ import annotations

import pytest
import torch

from stages import invariant_matmul
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


def _table_configs() -> tuple[set, set]:
    """(plain, variant) configurations `invariant_matmul.tiles` returns in bf16 for compile_sm90.MATMUL_SHAPES (the
    same expression: that script runs in the Triton venv) at a row count of each bucket."""
    shapes = (*invariant_matmul.SWEPT, (3072, 1024), (1024, 1024))
    picked = {invariant_matmul.tiles(m, n, k, torch.bfloat16) for n, k in shapes for m in (1, 100, 200, 4000)}
    variants = {cfg for cfg in picked if cfg.tma or cfg.persistent or cfg.split_k > 1}
    return picked - variants, variants


def test_invariant_matmul_compiles_for_sm90_without_spills(compiled):
    """Every plain tile configuration `invariant_matmul.tiles` picks for the 1.7B/0.6B products at every row
    bucket, per dtype, as nn.Linear launches it (B = weight.t(), bias) and with a contiguous B: no spills, and
    bf16/fp16 on the tensor cores (wgmma; fp32 runs IEEE FMAs)."""
    result = compiled["matmul"]
    plain, _ = _table_configs()
    # bf16 and fp16 share the table; fp32 has two configurations (BLOCK_N 32 and 64); x 2 layouts
    assert len(result) == 2 * (2 * len(plain) + 2)
    for name, (registers, spill_bytes, wgmma) in result.items():
        assert 0 < registers <= 255 and spill_bytes == 0, (name, registers, spill_bytes)
        assert (wgmma > 0) == (not name.startswith("fp32")), (name, wgmma)


def test_invariant_matmul_hopper_variants_compile_for_sm90_without_spills(compiled):
    """Every Hopper-variant configuration `tiles()` returns (`SWEPT`'s TMA loads through device-side descriptors,
    persistent programs, split-K with its in-order sum), bf16 as nn.Linear launches it, plus a contiguous-B TMA
    form with bias and an fp32 one: no spills, wgmma on bf16, TMA copies (cp.async.bulk.tensor) exactly in the TMA
    variants, and the sum kernel's loads vectorized."""
    result = compiled["matmul_variants"]
    _, variants = _table_configs()
    splits = {cfg.split_k for cfg in variants if cfg.split_k > 1} | {2}
    # the table's variants, 2 extra TMA forms, the sum per split count x bias
    assert len(result) == len(variants) + 2 + 2 * len(splits)
    for name, (registers, spill_bytes, *counts) in result.items():
        assert 0 < registers <= 255 and spill_bytes == 0, (name, registers, spill_bytes)
        if name.startswith("sum"):
            assert counts[0] > 0, (name, counts)  # 16-byte loads of the fp32 partials
            continue
        assert (counts[0] > 0) == name.startswith("bf16"), (name, counts)  # wgmma
        assert (counts[1] > 0) == (" tma" in name), (name, counts)  # TMA copies only where asked


def test_window_product_compiles_for_sm90_without_spills(compiled):
    """The deterministic Code2Wav's convolution kernel (stages/window_product.py) at every tile configuration
    `window_product.tiles` picks for the released decoder, channels-last and channel-first input: no spills, on
    the tensor cores."""
    result = compiled["window_products"]
    assert len(result) == 2 * 2  # two tile configurations (64 and 16 columns) x two layouts
    for name, (registers, spill_bytes, wgmma) in result.items():
        assert 0 < registers <= 255 and spill_bytes == 0 and wgmma > 0, (name, registers, spill_bytes, wgmma)
