"""RVQ dequantizer: 16 code indices per frame -> one continuous latent frame (decode side only).

The module tree (`rvq_first`/`rvq_rest` -> `vq.layers.N._codebook`) only exists to mirror the official
checkpoint names; the encoder-side `input_proj` convs are kept for the same reason but never used here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Codebook(nn.Module):
    """One codebook stored as EMA statistics: entry = embedding_sum / max(cluster_usage, 1e-5)."""

    def __init__(self, size: int, dim: int, eps: float = 1e-5):
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))
        self.eps = eps

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, dim]
        # Gather first, divide after: elementwise identical to dividing the whole table, 2048x less work.
        usage = self.cluster_usage.clamp(min=self.eps)[:, None]
        return F.embedding(codes, self.embedding_sum) / F.embedding(codes, usage)


class ResidualGroup(nn.Module):
    """A group of residual codebooks: sum of their entries, then a k1 conv up to the output width."""

    def __init__(self, num_codebooks: int, size: int, dim: int, out_dim: int):
        super().__init__()
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)  # encoder side, checkpoint only
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        layers = nn.ModuleList(nn.ModuleDict({"_codebook": Codebook(size, dim)}) for _ in range(num_codebooks))
        self.vq = nn.ModuleDict({"layers": layers})

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, K, T] -> [B, out_dim, T]
        layers = self.vq["layers"]
        total = layers[0]["_codebook"](codes[:, 0])
        for k in range(1, codes.shape[1]):  # sequential sum: same rounding as the official loop
            total = total + layers[k]["_codebook"](codes[:, k])
        return self.output_proj(total.transpose(1, 2))


class SplitResidualDequantizer(nn.Module):
    """Codebook 0 (semantic) and codebooks 1.. (acoustic) have separate projections; their outputs add."""

    def __init__(self, num_quantizers: int, num_semantic: int, size: int, out_dim: int):
        super().__init__()
        self.num_semantic = num_semantic
        dim = out_dim // 2
        self.rvq_first = ResidualGroup(num_semantic, size, dim, out_dim)
        self.rvq_rest = ResidualGroup(num_quantizers - num_semantic, size, dim, out_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:  # [B, K, T] -> [B, out_dim, T]
        return self.rvq_first(codes[:, : self.num_semantic]) + self.rvq_rest(codes[:, self.num_semantic :])
