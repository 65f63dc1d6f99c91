"""The decode attention kernel on tensor cores against the CUDA-core kernel and exact attention, on CPU under
Triton's interpreter (tests/triton_interpreter.py, tests/interpreted/decode_attention.py). On CUDA:
tests/stages/gpu/test_talker_engine_gpu.py (bf16; the engine against the reference generator)."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import run_interpreted


@pytest.mark.slow  # a Triton interpreter subprocess
def test_tensor_core_decode_kernel_equals_exact_attention():
    """fp32: rows of several key tiles (partial last tile, shuffled pages), one or two query heads per KV head, keys
    split over 1-4 programs: both kernels within fp32 rounding of float64 attention; with the new key stored and
    q/k's head norm and RoPE in the kernel, the tensor-core kernel's output and stored key/value equal the CUDA-core
    kernel's; and both kernels on the code predictor's contiguous cache."""
    result = run_interpreted("decode_attention.py")
    # tl.dot needs >= 16 along the reduced axis (the head dim in q k^T): Triton refuses to compile the tensor-core
    # path for the tiny code predictor's 8-wide heads (the interpreter does not check), so those run on CUDA cores
    assert result.pop("tensor_cores_by_head_dim") == {"8": False, "16": True, "128": True}
    for group, errors in result.items():
        for name, err in errors.items():
            assert err <= 2e-6, (group, name, err)
    for group in ("gqa2", "gqa1"):
        assert {"tensor_cores_splits4", "tensor_cores_split4_step_vs_cuda_cores"} <= set(result[group]), group
    # the code predictor's contiguous cache: both kernels at 1, 9 and 16 keys, the new key stored
    assert len(result["contiguous"]) == 12
    # heads narrower than tensor cores take (the tiny code predictor's 8): on CUDA cores, tensor-core tiling or not
    assert len(result["contiguous_head_dim8"]) == 12
