
"""The decode path's Triton kernels compile for the H100 (sm_90), in every variant the engine launches, without
register spills and with vectorized loads: Triton's compiler and ptxas run on CPU in the Triton venv
(tests/triton_interpreter.py, tests/interpreted/compile_sm90.py). What they compute is checked by the
interpreter tests beside this one."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores


def test_decode_kernels_compile_for_sm90_without_spills():
    result = run_interpreted("compile_sm90.py", interpret=False)
    # 10 products (8 layer products, the head, the input projection) x (4 row counts + 1 row with PDL); 4
    # attention tilings x 3 (plain, new-K/V store, + head prologue) + split kernel and merge at
    # 2 and 16 splits and at 16 with PDL, + PDL without splits (no merge); 2 vocab sizes x (plain, PDL)
    assert [len(result[k]) for k in ("gemv", "attention", "sampling")] == [50, 19, 4]
    for group, variants in result.items():
        for name, (registers, spill_bytes, vector_loads) in variants.items():
            assert 0 < registers <= 255 and spill_bytes == 0, (group, name, registers, spill_bytes)
            # with the launcher's 16-byte alignment facts, weights and K/V are read in 8-16 byte loads
            assert vector_loads > 0, (group, name)
