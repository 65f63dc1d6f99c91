
"""q/k's head norm and RoPE inside the decode attention kernel (`HeadNorm`, stages/talker/paged_attention.py;
`heads_in_attention` in stages/layers.py), checked on CPU under Triton's interpreter (tests/triton_interpreter.py).
On CUDA: tests/stages/gpu/test_talker_engine_gpu.py (bf16, and the engine against the reference generator)."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores


def test_decode_kernel_applies_head_norm_and_rope_as_the_eager_layers_do():
    """fp32: the kernel given projected q/k equals heads_norm_rope then the kernel (its output and the key it
    stores, paged and contiguous caches; one program per row and KV head, or keys split over several), and
    decoder stacks with heads_in_attention (with and without the GEMVs, with and without split keys) equal their
    eager layers, with every decode forward through the kernel's head prologue."""
    result = run_interpreted("heads_in_attention.py")
    for name, err in result["kernel"].items():
        assert err <= 1e-6, (name, err)  # seen: <= 4.8e-7
    # split keys (`splits`): the new key stored by the split holding it, partials merged, empty splits included
    splits = {"paged_split2_out", "paged_split4_out", "paged_split4_stored_k", "paged_split8_read_only"}
    assert splits <= set(result["kernel"])
    stacks = result["stacks"]
    for gemv_rows in (0, 8):
        for cache, calls in (("contiguous", 8), ("paged", 6)):  # (2 + 1 + 1) positions x 2 layers; 3 steps x 2
            name = f"{cache}_gemv{gemv_rows}"
            assert stacks[name] <= 1e-6, (name, stacks[name])  # seen: <= 3e-8
            assert stacks[f"{name}_head_norm_calls"] == calls, name
        assert stacks[f"paged_split_gemv{gemv_rows}"] <= 1e-6, stacks[f"paged_split_gemv{gemv_rows}"]
