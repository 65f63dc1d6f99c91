"""What the decode-path kernels compute, in PyTorch, and the decoder-stack runs their tests share (CPU tests,
GPU tests, and the scripts in tests/interpreted/, which import this module from the repo root)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.config import TransformerConfig
from stages.layers import DecoderStack, _rms


def pytorch_gemv(x, weight, norm=None, swiglu=False, residual=None, blocks=None, out_dtype=None, pdl=False,
                 bias=None) -> torch.Tensor:
    """stages.gemv_kernels.gemv in PyTorch ops: (RMSNorm(x) if norm) @ weight^T (+ bias), then SwiGLU and/or +
    residual."""
    y = F.linear(_rms(x, *norm) if norm is not None else x, weight, bias)
    if swiglu:
        gate, up = y.split(weight.shape[0] // 2, dim=-1)
        y = F.silu(gate) * up
    y = y + residual if residual is not None else y
    return y.to(out_dtype) if out_dtype is not None else y


def random_stack(cfg: TransformerConfig, std: float = 0.1, seed: int = 0, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> DecoderStack:
    """A decoder stack with N(0, std) weights, placed, then its projections fused (what the engine's kernels act
    on; fusing after `.to()` keeps the separate weights views of the stacked ones)."""
    torch.manual_seed(seed)
    stack = DecoderStack(cfg)
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(0.0, std)
    stack.to(device, dtype).eval().fuse_projections()
    return stack


def forwards(stack: DecoderStack, x: torch.Tensor, widths: tuple[int, ...], kv) -> torch.Tensor:
    """Forwards of `widths` new positions each over the same cache `kv` (a ContiguousKV): [B, sum(widths), H]."""
    b = x.shape[0]
    parts, start = [], 0
    with torch.no_grad():
        for s in widths:
            kv.begin(s)
            positions = torch.arange(start, start + s, device=x.device).expand(b, s)
            parts.append(stack(x[:, start:start + s], positions, kv).float())
            kv.advance()
            start += s
    return torch.cat(parts, dim=1)
