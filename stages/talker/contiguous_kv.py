"""KV caches for the eager paths: a contiguous per-batch cache where all rows share one offset.

Used by the reference generator (one request) and by the code predictor, whose 16-position
sequence restarts every frame. The batched engine's slot cache lives in stages/talker/.
"""

from __future__ import annotations

import torch

from stages.talker.paged_attention import DecodeTiling, HeadNorm, contiguous_decode_attention, kernel_available


class ContiguousKV:
    """Preallocated [B, n_kv, max_len, D] per layer; every row is at the same position `length`.

    Call `advance(s)` after each forward of `s` new positions. The first forward (length 0) is causal
    among its own rows; later ones attend to everything cached so far (one new row at a time, or a
    block that is causal within itself via an explicit mask).
    """

    KERNEL_MAX_ROWS = 4  # on CUDA, forwards of at most this many new rows use the decode kernel (decode_attention)

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str, decode_kernel: bool = True, pdl: bool = False,
                 tiling: DecodeTiling | None = None):
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.pdl = pdl  # the decode kernel launches with programmatic dependent launch (stages/pdl.py)
        self.tiling = tiling  # the decode kernel's; None: by the batch (contiguous_tiling)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # one-position decode steps on CUDA: the Triton decode kernel (stages/talker/paged_attention.py)
        # instead of SDPA, whose kernels are tiled for far more keys than this cache holds
        self.decode_kernel = decode_kernel and kernel_available(torch.device(device))
        if self.decode_kernel:
            self._rows = torch.arange(batch, device=device)[:, None]
            self._lengths = torch.arange(max_len + 1, device=device)  # [n:n+1]: "n keys", a static address
        self.max_len = max_len
        self.length = 0
        self._pending = 0
        self.mask: torch.Tensor | None = None
        self.is_causal = True

    def begin(self, s: int) -> None:
        """Prepare for a forward of `s` new positions."""
        if self.length + s > self.max_len:
            raise RuntimeError(f"KV cache full: {self.length} + {s} > {self.max_len}")
        self._pending = s
        self.is_causal = self.length == 0
        if self.is_causal or s == 1:
            self.mask = None
        else:  # a block appended to a non-empty cache: causal within the block
            total = self.length + s
            q_pos = torch.arange(self.length, total, device=self.k[0].device)[:, None]
            self.mask = (torch.arange(total, device=self.k[0].device)[None, :] <= q_pos)[None, None]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[2]
        self.k[layer_idx][:, :, self.length:end] = k
        self.v[layer_idx][:, :, self.length:end] = v
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def folds_heads(self, s: int) -> bool:
        """A forward of `s` new positions runs on the decode kernel, which can apply q/k's head norm and RoPE."""
        return self.decode_kernel and s <= self.KERNEL_MAX_ROWS

    def decode_attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         head_norm: HeadNorm | None = None) -> torch.Tensor:
        """q [B, H, S, D] and the new k/v [B, n_kv, S, D] of a forward -> [B, S, H, D] (decode_kernel only).

        One kernel call per new row i: it stores row i's key/value at position length + i and attends to every
        key up to it (the cache's causal rule), so no separate copy into the cache runs. Meant for a few rows
        (`KERNEL_MAX_ROWS`), e.g. the code predictor's two-row first pass, for which SDPA's flash kernel took
        ~100 us per call at batch 256 on the H100 (a one-row call of this kernel there: ~17 us). With `head_norm`, q
        and k are the projections before the head norm and RoPE, which the kernel applies."""
        s = q.shape[2]
        rows = [contiguous_decode_attention(q[:, :, i], self.k[layer_idx], self.v[layer_idx], self._rows,
                                            self._lengths[self.length + i + 1:self.length + i + 2], self.tiling,
                                            new_kv=(k[:, :, i], v[:, :, i]),
                                            head_norm=head_norm.at(i) if head_norm is not None else None,
                                            pdl=self.pdl)
                for i in range(s)]
        return torch.stack(rows, dim=1) if s > 1 else rows[0][:, None]

    def advance(self) -> None:
        self.length += self._pending
        self._pending = 0

    def reset(self) -> None:
        self.length = 0
