"""The few-row Triton GEMVs (stages/gemv_kernels.py) against PyTorch, alone and as a decoder layer.

Marked `gpu`: they run on the GPU machine (`python -m pytest -m gpu tests/stages`), CPU CI skips them. In fp32 the
kernels differ from PyTorch by summation order only; in bf16 they round where the eager ops round, so the
difference is the products' accumulation order, a bf16 ulp of the output now and then.
"""

from __future__ import annotations

import pytest
import torch

from stages import gemv_kernels
from stages.config import TransformerConfig
from stages.layers import LayerKernels, attention_inputs, attention_output_and_mlp
from stages.talker.contiguous_kv import ContiguousKV
from tests.kernel_reference import forwards, pytorch_gemv, random_stack

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("flags", ["", "norm", "residual", "norm,swiglu", "norm,swiglu,residual", "bias"])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (200, 328)])  # the last: no tile divides it
def test_gemv_matches_pytorch(dtype, rtol, flags, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    swiglu = "swiglu" in flags
    w = (torch.randn(2 * n if swiglu else n, k, generator=gen, device="cuda") / k ** 0.5).to(dtype)
    for m in (1, 2, 3, 8):
        x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
        norm = ((torch.rand(k, generator=gen, device="cuda") + 0.5).to(dtype), 1e-6) if "norm" in flags else None
        res = torch.randn(m, n, generator=gen, device="cuda").to(dtype) if "residual" in flags else None
        bias = torch.randn(n, generator=gen, device="cuda").to(dtype) if "bias" in flags else None
        ref = pytorch_gemv(x, w, norm, swiglu, res, bias=bias).float()
        out = gemv_kernels.gemv(x, w, norm, swiglu, res, bias=bias).float()
        scale = ref.abs().max().item()
        err = (out - ref).abs().max().item()
        print(f"gemv {dtype} {flags or 'plain'} {m}x{k} -> {n}: max abs err {err:.2e} (max |y| {scale:.2f})")
        assert err <= rtol * max(scale, 1.0), (m, err, scale)


CFG = TransformerConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_gemv_layer_path_matches_eager(dtype, rtol):
    """A stack's decode forwards (one row; the code predictor's two-row first pass) through the GEMV path against
    its eager layers, over the same cache contents: what the engine's batch-1 graphs run."""
    dt = getattr(torch, dtype)
    stack = random_stack(CFG, device="cuda", dtype=dt)
    kernels = LayerKernels(pre=attention_inputs, post=attention_output_and_mlp, gemv_rows=8)
    for b, widths in ((1, (2, 1, 1, 1)), (2, (2, 1, 1)), (4, (2, 1))):
        x = torch.randn(b, sum(widths), CFG.hidden_size, device="cuda").to(dt)
        out = {}
        for name, k in (("eager", None), ("gemv", kernels)):
            stack.kernels = k
            out[name] = forwards(stack, x, widths, ContiguousKV(CFG.num_hidden_layers, b, CFG.num_key_value_heads,
                                                                CFG.head_dim, sum(widths), dt, "cuda"))
        stack.kernels = None
        scale = out["eager"].abs().max().item()
        err = (out["gemv"] - out["eager"]).abs().max().item()
        print(f"gemv layer path vs eager, {dtype}, batch {b}, widths {widths}: max abs err {err:.2e} "
              f"(max |h| {scale:.2f})")
        assert err <= rtol * max(scale, 1.0), (b, err, scale)



def test_pdl_chain_in_a_cuda_graph_equals_the_plain_launches():
    """A layer's four GEMVs with programmatic dependent launch (each loads its first weight tile before waiting
    for the kernel before it), captured in a CUDA graph and replayed on new inputs: bit-identical to the same
    kernels launched plainly, so no kernel read its input before the previous one had written it."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inner, dt = 1024, 3072, torch.bfloat16

    def weights(rows, cols):
        return (torch.randn(rows, cols, generator=gen, device="cuda") / cols ** 0.5).to(dt)

    qkv_w, o_w, gate_up_w, down_w = weights(1024, hidden), weights(hidden, 1024), weights(2 * inner, hidden), \
        weights(hidden, inner)
    norm = ((torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(dt), 1e-6)
    x = torch.randn(1, hidden, generator=gen, device="cuda").to(dt)

    def layer(pdl):
        h = gemv_kernels.gemv(x, qkv_w, norm=norm, pdl=pdl)
        h = gemv_kernels.gemv(h, o_w, residual=x, pdl=pdl)
        act = gemv_kernels.gemv(h, gate_up_w, norm=norm, swiglu=True, pdl=pdl)
        return gemv_kernels.gemv(act, down_w, residual=h, pdl=pdl)

    layer(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(True)
    for _ in range(5):
        x.copy_(torch.randn(1, hidden, generator=gen, device="cuda").to(dt))
        graph.replay()
        assert torch.equal(out, layer(False))
