
"""The decode path's Triton kernels compile for the H100 (sm_90), in every variant the engine launches, without
register spills and with vectorized loads: Triton's compiler and ptxas run on CPU in the Triton venv
(tests/triton_interpreter.py, tests/interpreted/compile_sm90.py). What they compute is checked by the
interpreter tests beside this one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from stages import window_product
from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every group's variants, compiled in two processes at once (Triton's compiler and ptxas use one core each)."""
    shares = (("gemv",), ("attention", "sampling", "snake", "state_carry_kernels", "window_products"))
    with ThreadPoolExecutor(len(shares)) as pool:
        results = pool.map(lambda groups: run_interpreted("compile_sm90.py", *groups, interpret=False), shares)
        return {group: variants for result in results for group, variants in result.items()}


def test_decode_kernels_compile_for_sm90_without_spills(compiled):
    result = {group: compiled[group] for group in ("gemv", "attention", "sampling")}
    # 10 products (8 layer products, the head, the input projection) x (4 row counts + 1 row with PDL); 4
    # CUDA-core attention tilings x 3 (plain, new-K/V store, + head prologue) + split kernel and merge at
    # 2 and 16 splits and at 16 with PDL, + PDL without splits (no merge), + 8 tensor-core variants (2 tilings,
    # splits 2 / 16 / 16 with PDL, PDL alone; the contiguous cache's below 64 rows, plain and PDL); 2 vocab sizes x
    # (plain, PDL)
    assert [len(result[k]) for k in ("gemv", "attention", "sampling")] == [50, 27, 4]
    for group, variants in result.items():
        for name, (registers, spill_bytes, vector_loads) in variants.items():
            assert 0 < registers <= 255 and spill_bytes == 0, (group, name, registers, spill_bytes)
            # with the launcher's 16-byte alignment facts, weights and K/V are read in 8-16 byte loads
            assert vector_loads > 0, (group, name)


def test_snake_kernels_take_the_sfu_sine(compiled):
    """The vocoder's SnakeBeta kernels compile with the SFU's sine (one `sin.approx` per element of a thread's share
    of the 64 x 64 tile) and no local memory in their PTX: libdevice's exact `sinf` keeps its reduction table there
    (160 accesses per kernel), which made these one-read one-write kernels arithmetic-bound. ptxas keeps one variant
    at 64 registers with a 16-byte spill; measured as it is (docs/benchmarks.md, "SnakeBeta's sine on the SFU")."""
    result = compiled["snake"]
    assert len(result) == 4
    for name, (registers, spill_bytes, sines, local) in result.items():
        assert 0 < registers <= 255 and spill_bytes <= 16, (name, registers, spill_bytes)
        assert sines == 32 and local == 0, (name, sines, local)


def test_the_state_carry_kernel_compiles_with_its_barrier(compiled):
    """The stateful decode's carry kernel (stages/code2wav/state_carry.py) compiles at every state width the released
    decoder carries, without spills, with the barrier that keeps its writes of a slot after all its reads."""
    result = compiled["state_carry_kernels"]
    assert len(result) == 4
    for name, (registers, spill_bytes, barriers) in result.items():
        assert 0 < registers <= 255 and spill_bytes == 0 and barriers >= 1, (name, registers, spill_bytes, barriers)


def test_window_product_compiles_for_sm90_on_the_tensor_cores(compiled):
    """The deterministic Code2Wav's convolution kernel (stages/window_product.py) at every tile configuration
    `window_product.tiles` picks for the released decoder, channels-last and channel-first input: it compiles, on
    the tensor cores; the fallback tiles (problems the sweep did not time) without spills. A swept configuration may
    spill: the sweep timed it faster on the H200 as it is."""
    result = compiled["window_products"]
    fallback = {window_product.tiles(96, 1536), window_product.tiles(192, 1)}  # 64+ and fewer output columns
    configs = {window_product.tiles(c, n) for c, n in window_product.SWEPT} | fallback
    assert len(result) == 2 * len(configs)  # every configuration x two layouts
    names = {f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}" for t in fallback}
    for name, (registers, spill_bytes, wgmma) in result.items():
        assert 0 < registers <= 255 and wgmma > 0, (name, registers, wgmma)
        if name.rsplit(" ", 1)[0] in names:
            assert spill_bytes == 0, (name, registers, spill_bytes)
