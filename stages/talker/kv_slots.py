"""The engine's talker KV cache: one dense region per slot, and the attention contexts over it.

Running requests always occupy slots 0..n-1 (the engine compacts on finish), so a decode step of
batch b reads `k[:, :b]` with no gather, and a CUDA graph per batch bucket sees fixed addresses.
Attention only reads the first `attn_len` positions (a length bucket), not the whole slot.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_slots, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots, self.max_len = num_slots, max_len

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class PrefillContext:
    """Prompts written into `slots` [n] (a device tensor), right-padded to one length, causal from position 0.

    Slots are a tensor, not a range, so a CUDA graph of the prefill serves any admission: padding rows
    point at the runner's scratch slot.
    """

    is_causal = True
    mask = None

    def __init__(self, cache: SlotKVCache, slots: torch.Tensor):
        self.cache, self.slots = cache, slots

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = k.shape[2]
        self.cache.k[layer_idx, self.slots, :, :s] = k
        self.cache.v[layer_idx, self.slots, :, :s] = v
        return k, v


class DecodeContext:
    """One new position per row for slots [0, b); row i writes at positions[i] and attends to <= it."""

    is_causal = False

    def __init__(self, cache: SlotKVCache, positions: torch.Tensor, attn_len: int):
        b = positions.shape[0]
        self.cache, self.positions, self.attn_len = cache, positions, attn_len
        self.rows = torch.arange(b, device=positions.device)
        keys = torch.arange(attn_len, device=positions.device)
        self.mask = (keys[None, :] <= positions[:, None])[:, None, None, :]  # [b, 1, 1, L]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = k.shape[0]
        kl, vl = self.cache.k[layer_idx], self.cache.v[layer_idx]
        kl[self.rows, :, self.positions] = k[:, :, 0]
        vl[self.rows, :, self.positions] = v[:, :, 0]
        return kl[:b, :, :self.attn_len], vl[:b, :, :self.attn_len]
