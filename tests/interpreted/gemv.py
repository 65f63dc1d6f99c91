"""Runs under Triton's interpreter (tests/triton_interpreter.py): the few-row GEMVs of stages/gemv_kernels.py
against PyTorch in fp32, alone and as a decoder stack's decode forwards. Prints the max errors as JSON."""

from __future__ import annotations

import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch

from stages import gemv_kernels
from stages.config import TransformerConfig
from stages.layers import LayerKernels, attention_inputs, attention_output_and_mlp
from stages.talker.contiguous_kv import ContiguousKV
from tests.kernel_reference import forwards, pytorch_gemv, random_stack


def products() -> dict:
    """Max |kernel - PyTorch| / max(|PyTorch|, 1) per flag set, over rows 1-8, shapes with and without ragged
    tiles, the default tiling and a small explicit one."""
    gen = torch.Generator().manual_seed(0)
    worst = {}
    for flags in ("", "norm", "residual", "norm,swiglu", "norm,swiglu,residual", "bias"):
        swiglu = "swiglu" in flags
        for n, k in ((64, 128), (40, 72)):  # tiles that divide, ragged tiles
            w = torch.randn(2 * n if swiglu else n, k, generator=gen) / k ** 0.5
            for m in (1, 3, 8):
                x = torch.randn(m, k, generator=gen)
                norm = (torch.rand(k, generator=gen) + 0.5, 1e-6) if "norm" in flags else None
                res = torch.randn(m, n, generator=gen) if "residual" in flags else None
                bias = torch.randn(n, generator=gen) if "bias" in flags else None
                ref = pytorch_gemv(x, w, norm, swiglu, res, bias=bias)
                for blocks in (None, (8, 32, 4)):
                    out = gemv_kernels.gemv(x, w, norm, swiglu, res, blocks=blocks, bias=bias)
                    err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()
                    worst[flags or "plain"] = max(worst.get(flags or "plain", 0.0), err)
    return worst


def layer_path() -> dict:
    """A 2-layer stack's decode forwards (1, 2 and 4 rows; the first forward of 2 positions, as the code
    predictor's first pass) through the GEMV path against its eager layers."""
    cfg = TransformerConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16)
    stack = random_stack(cfg)
    kernels = LayerKernels(pre=attention_inputs, post=attention_output_and_mlp, gemv_rows=8)
    worst = {}
    for b, widths in ((1, (2, 1, 1)), (2, (2, 1)), (4, (2, 1))):
        x = torch.randn(b, sum(widths), cfg.hidden_size)
        out = {}
        for name, k in (("eager", None), ("gemv", kernels)):
            stack.kernels = k
            out[name] = forwards(stack, x, widths, ContiguousKV(cfg.num_hidden_layers, b, cfg.num_key_value_heads,
                                                                cfg.head_dim, sum(widths), torch.float32, "cpu"))
        worst[f"batch{b}"] = ((out["gemv"] - out["eager"]).abs().max() / out["eager"].abs().max()).item()
    return worst


if __name__ == "__main__":
    print(json.dumps({"products": products(), "layer_path": layer_path()}))
