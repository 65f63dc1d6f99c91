
"""stages/sampling_kernel.py (token selection as one Triton program per row) on CPU under Triton's interpreter
(tests/triton_interpreter.py); on CUDA: tests/stages/gpu/test_sampling_gpu.py."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores


def test_sampling_kernel_draws_what_select_tokens_draws():
    """Every combination of sampling/greedy, temperature, top-k (1 .. off) and top-p (off .. 0.02), masked ids
    and tied scores (some at the top-k boundary), two vocabulary sizes (a power of two, and one padded to the
    next): the same ids as select_tokens for the same seeds and counters (also when given as counters - 7 with
    counter_offset 7), always a finite-logit id."""
    result = run_interpreted("sampling_kernel.py")
    assert len(result) == 2
    for name, r in result.items():
        assert r["rows"] == 120 and r["sampled_rows"] == 60, name
        assert r["equal"] == r["rows"], (name, r)  # fp32, summation order only: no race that close here
        assert r["offset_equal"] == r["rows"], (name, r)  # counters - 7 with counter_offset 7
        assert r["finite_choice"] == r["rows"], (name, r)
        assert r["distinct_tokens"] > 100, (name, r)  # the rows' draws differ from one another
