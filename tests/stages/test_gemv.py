"""The few-row GEMV path of the decoder layers (stages/gemv_kernels.py) on CPU: what the Triton kernels compute,
under Triton's interpreter (tests/triton_interpreter.py), and which forwards take the path.
The same comparisons in fp32 and bf16 on CUDA: tests/stages/gpu/test_gemv_gpu.py."""

from __future__ import annotations

import pytest
import torch

from stages import gemv_kernels
from stages.config import TransformerConfig
from stages.layers import DecoderStack, LayerKernels, attention_inputs, attention_output_and_mlp
from stages.talker.contiguous_kv import ContiguousKV
from tests.kernel_reference import pytorch_gemv
from tests.triton_interpreter import run_interpreted

pytestmark = pytest.mark.slow  # Triton interpreter / Inductor subprocesses: minutes on 2 cores


def test_gemv_kernels_compute_what_pytorch_does():
    """fp32 under the interpreter: every flag set (norm prologue, SwiGLU and residual epilogues) over 1-8 rows and
    ragged tiles, and a stack's decode forwards through the GEMV path against its eager layers."""
    result = run_interpreted("gemv.py")
    assert set(result["products"]) == {"plain", "norm", "residual", "norm,swiglu", "norm,swiglu,residual", "bias"}
    for flags, err in result["products"].items():
        assert err <= 2e-6, (flags, err)  # summation order only (seen: <= 6.1e-7)
    for batch, err in result["layer_path"].items():
        assert err <= 1e-6, (batch, err)  # seen: <= 6.6e-8


CFG = TransformerConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16)


def test_forwards_of_up_to_gemv_rows_rows_take_the_gemv_path(monkeypatch):
    """Batch x positions decides: 1 and 2 rows (gemv_rows=2) run four GEMVs per layer, 3 rows and a 2-position
    forward of 2 rows the GEMM path; the unfused (eager) stack never does, and the results equal eager."""
    rows_seen = []

    def gemv(x, *args, **kwargs):
        rows_seen.append(x.shape[0])
        return pytorch_gemv(x, *args, **kwargs)  # a stand-in for the kernel on CPU

    monkeypatch.setattr(gemv_kernels, "gemv", gemv)
    torch.manual_seed(0)
    stack = DecoderStack(CFG).eval()
    stack.fuse_projections()
    for b, s in ((1, 1), (2, 1), (3, 1), (2, 2), (1, 2)):
        x = torch.randn(b, s, CFG.hidden_size)
        out = {}
        for name, kernels in (("eager", None),
                              ("gemv", LayerKernels(pre=attention_inputs, post=attention_output_and_mlp, gemv_rows=2))):
            stack.kernels = kernels
            kv = ContiguousKV(CFG.num_hidden_layers, b, CFG.num_key_value_heads, CFG.head_dim, s, torch.float32, "cpu")
            kv.begin(s)
            with torch.no_grad():
                out[name] = stack(x, torch.arange(s).expand(b, s), kv)
        torch.testing.assert_close(out["gemv"], out["eager"], rtol=1e-5, atol=1e-6)
    layers = CFG.num_hidden_layers
    assert rows_seen == [1] * 4 * layers + [2] * 4 * layers + [2] * 4 * layers  # (1,1), (2,1), (1,2)


def test_gemv_rows_is_bounded_by_what_one_pass_handles():
    with pytest.raises(ValueError, match="gemv_rows"):
        LayerKernels.compiled(gemv_rows=gemv_kernels.MAX_ROWS + 1)
