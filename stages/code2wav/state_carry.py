"""A carried conv's state in and out of a chunk's padded input, in one kernel (the stateful decode's hot path).

Before each causal conv of the fused vocoder, the kernel ahead of it wrote `n` zero columns in front of the conv's
input (`padded` [B, C, n + T + ...]); the stateful decode (stages/code2wav/stateful.py) fills them with each row's
carried state and saves the state after the row's valid samples:

    padded[b, :, :n]     <- state[slots[b]]                          (zeros where the row starts fresh)
    state[slots[b]]      <- padded[b, :, L : L + n], L = lengths[b] * rate   (read after the fill above)

In PyTorch that is five launches per conv (a gather of the slots' states, a select for fresh rows, the copy into
`padded`, a gather of each row's window, a scatter into the slots), each a pass over small tensors: at one stream a
chunk's ~18 carried convs spend more time launching than moving bytes, and at 256 streams the passes add up
(docs/code2wav.md). The kernel does it in one launch per conv: one program per (row, channel block) reads the old
state and the new window, then, after a barrier (the window may lie in the state columns it overwrites), writes
both. Rows that start fresh never read their slot (padding rows share the scratch slot); bits are copied, never
rounded, so the result equals the PyTorch path (`stateful._Rows.carry_with_torch_ops`, what CPU decodes run) exactly
(tests/interpreted/state_carry.py, tests/stages/gpu/test_state_carry_gpu.py).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_ELEMENTS = 1024  # per program (4 warps): a 64-column state as 64 x 16 channels; wider tiles spill registers


def block_c(block_n: int) -> int:
    """Channels per program for `block_n` state columns."""
    return max(16, min(64, _ELEMENTS // block_n))


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _carry_kernel(p_ptr, s_ptr, slot_ptr, keep_ptr, len_ptr, C, N, RATE, spb, spc, spt, ssr, ssc, sst,
                      BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        j = tl.arange(0, BLOCK_N)[:, None]
        ok = (j < N) & (c < C)
        keep = tl.load(keep_ptr + b) != 0
        slot = tl.load(slot_ptr + b).to(tl.int64)
        at = tl.load(len_ptr + b).to(tl.int64) * RATE + j  # where column j of the new state is in `padded`
        state = s_ptr + slot * ssr + c.to(tl.int64) * ssc
        row = p_ptr + b.to(tl.int64) * spb + c.to(tl.int64) * spc
        old = tl.load(state + j * sst, mask=ok & keep, other=0.0)
        in_state = at < N  # a row with fewer than n new samples keeps part of its old state
        new = tl.where(in_state, tl.load(state + at * sst, mask=ok & in_state & keep, other=0.0),
                       tl.load(row + at * spt, mask=ok & (at >= N), other=0.0))
        tl.debug_barrier()  # every read of the slot's old state is done before any thread writes it
        tl.store(row + j * spt, old.to(p_ptr.dtype.element_ty), mask=ok)
        tl.store(state + j * sst, new.to(s_ptr.dtype.element_ty), mask=ok)


def carry(padded: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor,
          lengths: torch.Tensor, rate: int) -> torch.Tensor:
    """Fill `padded`'s first n = state.shape[-1] columns with each row's state (zeros where `keep` is False) and
    save the state after its valid samples, in place; returns `padded`. padded [B, C, n + ...] (any strides),
    state [slots + 1, C, n], slots / lengths [B] long, keep [B] bool. CUDA, or any device under Triton's interpreter
    (the PyTorch path, where `available` is False: `stateful._Rows.carry_with_torch_ops`)."""
    B, C, _ = padded.shape
    n = state.shape[-1]
    block_n = triton.next_power_of_2(n)
    grid = (B, triton.cdiv(C, block_c(block_n)))
    _carry_kernel[grid](padded, state, slots, keep, lengths, C, n, rate, *padded.stride(), *state.stride(),
                        BLOCK_N=block_n, BLOCK_C=block_c(block_n))
    return padded
