
"""One codec frame's code-predictor loop with every opt-in kernel path at once, on CPU under Triton's interpreter
(tests/triton_interpreter.py, tests/interpreted/frame.py): the GEMVs with the final norm + head fused
(stages/gemv_kernels.py), the later passes' inputs looked up in the projected embedding tables, q/k's head norm +
RoPE in the attention kernel, and the sampling kernel, against the eager path in fp32: the same 16 codes, greedy and
seeded sampling (one row each). The tiny talker's code predictor has 256 ids (2048 in the releases), which the
interpreter's GEMV for its head runs 8x faster."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores

PASSES, LAYERS = 15, 2  # the code predictor's passes per frame; the tiny model's code-predictor layers


def test_frame_with_every_kernel_path_draws_the_eager_codes():
    result = run_interpreted("frame.py", timeout=1200)
    assert result.pop("projection") == "Linear"  # the 1.7B layout: the talker twice as wide as the code predictor
    assert set(result) == {"batch2_mixed"}  # row 0 greedy, row 1 sampled (top-k 20, top-p 0.9)
    for name, r in result.items():
        assert r["codes_equal"], (name, r)
        assert r["max_logit_diff"] <= 1e-5, (name, r)  # fp32, summation order (seen: <= 3.3e-6)
        # every pass through the GEMVs (4 per layer, the fused final norm and head; the input projection on the first
        # pass only: the later passes look up their input in the projected tables); every new position of every layer
        # through the kernel's head prologue (2 on the first pass); the eager run through neither
        gemvs = PASSES * (4 * LAYERS + 1) + 1
        assert r["kernel_calls"] == {"gemv": gemvs, "head_norm": (PASSES + 1) * LAYERS}, (name, r)
        assert r["eager_kernel_calls"] == {}, name
        assert r["distinct_codes"] > 8, (name, r)
