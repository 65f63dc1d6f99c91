"""The engine's talker KV cache in fixed-size blocks, and the attention contexts over it.

Keys and values of all requests live in one pool of token rows per layer, `[blocks * block_size, n_kv, D]`;
a request owns whole blocks, listed in its slot's row of `block_table` (device, int64). So:
- a request reserves only the blocks its own length bound needs (prompt + max frames), not a worst case;
- releasing a request returns its blocks and copies nothing: no request's KV ever moves;
- any attention kernel reads a row's keys through its block table (`paged_decode_attention`).

The last block is the scratch block: free slots' table rows point at it, and padding rows of graphed
steps and prefills write there, so a CUDA graph never needs to know which rows are real.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from stages.config import TransformerConfig
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.paged_attention import DecodeTiling, HeadNorm, decode_splits, paged_decode_attention


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_slots: int, max_seq_len: int, dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks  # one more block than the allocator hands out
        tokens = (num_blocks + 1) * block_size
        self.k = torch.zeros(num_layers, tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.blocks_per_seq = -(-max_seq_len // block_size)
        self.block_table = torch.full((num_slots, self.blocks_per_seq), self.scratch_block, dtype=torch.long,
                                      device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    def token_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pool rows of `positions` [..., n] of the requests in `slots` [...] (broadcast)."""
        bs = self.block_size
        blocks = torch.gather(self.block_table[slots], -1, (positions // bs).clamp(max=self.blocks_per_seq - 1))
        return blocks * bs + positions % bs


class PrefillContext:
    """Prompts [B, W] (right-padded, causal from position 0) written to the pool rows `write_index` [B, W].

    Padding positions of a row point at the scratch block, so nothing outside a request's blocks is written.
    """

    is_causal = True
    mask = None

    def __init__(self, cache: PagedKVCache, write_index: torch.Tensor):
        self.cache, self.write_index = cache, write_index.reshape(-1)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, s, d = k.shape
        self.cache.k[layer_idx].index_copy_(0, self.write_index, k.transpose(1, 2).reshape(b * s, h, d))
        self.cache.v[layer_idx].index_copy_(0, self.write_index, v.transpose(1, 2).reshape(b * s, h, d))
        return k, v


class DecodeContext:
    """One new position per row for the requests in slots [0, b): row i writes at positions[i], attends to <= it.

    `kernel=True` reads the keys in place through the block table (Triton, CUDA); otherwise the first
    `attn_len` positions of every row are gathered and attended with SDPA under a mask (the reference
    path, exact on any device). `split_keys` (kernel only): few rows spread each row's keys over several
    programs (`decode_splits`); `pdl` (kernel only): launched with programmatic dependent launch.
    """

    def __init__(self, cache: PagedKVCache, positions: torch.Tensor, attn_len: int, kernel: bool,
                 split_keys: bool = False, pdl: bool = False, tiling: DecodeTiling | None = None):
        b = positions.shape[0]
        self.tiling = tiling  # None: by the batch (decode_tiling)
        self.cache, self.positions, self.kernel = cache, positions, kernel
        self.pdl = pdl and kernel  # the kernel launches with programmatic dependent launch (stages/pdl.py)
        self.splits = decode_splits(b, cache.k.shape[2]) if kernel and split_keys else 1
        if kernel:  # the kernel finds each row's write position through the block table itself
            self.seq_lens = positions + 1
            self.table = cache.block_table[:b]
        else:
            slots = torch.arange(b, device=positions.device)
            self.write_index = cache.token_index(slots, positions[:, None])[:, 0]  # [b]
            keys = torch.arange(attn_len, device=positions.device)
            self.read_index = cache.token_index(slots, keys.expand(b, attn_len))  # [b, L]
            self.attn_mask = (keys[None, :] <= positions[:, None])[:, None, None, :]  # [b, 1, 1, L]

    def folds_heads(self, s: int) -> bool:
        """The kernel applies q/k's head norm and RoPE itself (`attend`'s `head_norm`)."""
        return self.kernel

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_norm: HeadNorm | None = None) -> torch.Tensor:
        """q [b, h, 1, D], new k/v [b, n_kv, 1, D] -> [b, 1, h*D]; the new k/v are stored first. With `head_norm`
        (kernel only), q and k are the projections before the head norm and RoPE, which the kernel applies."""
        kl, vl = self.cache.k[layer_idx], self.cache.v[layer_idx]
        b, heads, _, d = q.shape
        if self.kernel:  # the kernel stores the new k/v at position seq_lens - 1 = positions itself
            out = paged_decode_attention(q[:, :, 0], kl, vl, self.table, self.seq_lens, self.cache.block_size,
                                         new_kv=(k[:, :, 0], v[:, :, 0]), head_norm=head_norm, splits=self.splits,
                                         pdl=self.pdl, tiling=self.tiling)
            return out.reshape(b, 1, heads * d)
        assert head_norm is None, "the gather path attends over rotated q/k"
        kl.index_copy_(0, self.write_index, k[:, :, 0])
        vl.index_copy_(0, self.write_index, v[:, :, 0])
        n_kv = k.shape[1]
        keys = kl[self.read_index].transpose(1, 2)  # [b, n_kv, L, D]
        values = vl[self.read_index].transpose(1, 2)
        # the query heads sharing a KV head are rows of one [group, D] block: GQA without expanding K/V
        qg = q.reshape(b, n_kv, heads // n_kv, d)
        out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self.attn_mask)
        return out.reshape(b, 1, heads * d)


def kv_pool_blocks(cfg: TalkerEngineConfig, tcfg: TransformerConfig, device: torch.device, dtype: torch.dtype,
                   log: Callable[[str], None]) -> int:
    """The KV pool in blocks: `cfg.kv_cache_tokens`; unset, on CUDA `kv_cache_memory_fraction` of the device memory
    free now, less the transient peak the allocator recorded above what is allocated now (a warm-up forward's
    activations, which serving needs again; the engine warms up before it asks), as nano-vllm sizes its cache; on
    CPU room for every row at `max_seq_len`. At least one block: a request bigger than the pool is refused (400)."""
    per_token = PagedKVCache.bytes_per_token(tcfg.num_hidden_layers, tcfg.num_key_value_heads, tcfg.head_dim,
                                             dtype)
    tokens = cfg.kv_cache_tokens
    if tokens is None and device.type == "cuda":
        torch.cuda.empty_cache()  # what the warm-up cached and let go counts as free
        free, _total = torch.cuda.mem_get_info(device)
        transient = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        tokens = int(max(free - transient, 0) * cfg.kv_cache_memory_fraction) // per_token
    elif tokens is None:
        tokens = cfg.max_num_seqs * cfg.max_seq_len
    block = cfg.kernels.kv_block_size
    num_blocks = max(1, tokens // block)
    log(f"[talker] KV pool: {num_blocks} blocks x {block} positions "
        f"({num_blocks * block * per_token / 2**30:.2f} GiB), {cfg.max_num_seqs} rows")
    return num_blocks
