"""`select_tokens` (stages/sampling.py) as one Triton program per row: temperature, top-k, top-p and the draw
without sorting the vocabulary.

The compiled `select_tokens` sorts every row (for the k-th largest score and top-p's cumulative mass) and runs
5-6 more kernels around the sort; a frame samples 16 times (codebook 0, then the code predictor's 15), and on the
H100 the radix sorts alone took 0.33 ms of the 6.8 ms batch-1 step (`docs/benchmarks.md`, "Fewer kernels per
frame"). Here the row stays in registers and both thresholds are found by bisection on the scores' bits:
- each fp32 score maps to an order-preserving uint32 key; the k-th largest key is built from the top bit down,
  two bits a round, stopping once a candidate is met by exactly k keys (`_top_k_threshold`), and top-k keeps
  `key >= kth` (ties at the boundary kept, as the sort does);
- top-p (only for rows with top_p < 1) keeps an id while the probability mass strictly above its score is below
  top_p, which is what `mass_before < top_p` over the sorted row means: the largest key whose mass above is
  still >= top_p is found the same way (32 masked sums), and the ids above it stay;
- the draw is the same exponential race on the same counter-based uniforms (`uniform_from_counter`'s hash, in
  uint32), so a seeded request draws the same ids as with `select_tokens`, up to the summation order of the
  softmax (a race decided by less than that rounding may go the other way).
The code stays small (loops, not unrolled; uint32, not int64): in the decode step the kernel runs after ~40 others
and its instructions come from L2 again. On the H100 a version of 5,700 SASS instructions took 21.6 us per call
there against 10.3 us back to back; at 2,600, ~10 us.
"""

from __future__ import annotations

import torch

from stages import pdl
from stages.pdl import launch_args
from stages.sampling import SamplingTensors

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine samples with `select_tokens`
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _mix32(x):
        """stages/sampling._mix32 in uint32 arithmetic (its int64 values masked to 32 bits are these; a wrapping
        product is the masked one): one multiply each instead of int64's several, a vocabulary's worth per call."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x2C1B3C6D
        x = x ^ (x >> 12)
        x = x * 0x297A2D39
        return x ^ (x >> 15)

    @triton.jit
    def _top_k_threshold(key, k):
        """The k-th largest of the uint32 keys (ties at the boundary kept by `key >= threshold`), built from the
        top bit down two bits a round: the three candidates' counts of `key >= candidate` travel in one int64 sum
        (21 bits each), so a round is one reduction (a barrier across warps), not three. It stops early once a
        candidate is met by exactly k keys: that candidate already keeps the same ids as the exact k-th largest
        key (k keys >= it, so the k-th largest is >= it and the next one below it). One bit a round without the
        stop took 32 reductions: 21.6 us per call at batch 1 in the H100 step."""
        kth = tl.zeros([], tl.uint32)
        exact = tl.zeros([], tl.int32)
        r = tl.zeros([], tl.int32)
        while (r < 16) & (exact == 0):
            shift = (30 - 2 * r).to(tl.uint32)
            c1 = kth | (1 << shift)
            c2 = kth | (2 << shift)
            c3 = kth | (3 << shift)
            packed = tl.sum((key >= c1).to(tl.int64) + ((key >= c2).to(tl.int64) << 21)
                            + ((key >= c3).to(tl.int64) << 42), axis=0)
            n1 = packed & 0x1FFFFF
            n2 = (packed >> 21) & 0x1FFFFF
            n3 = packed >> 42
            met = tl.where(n3 >= k, n3, tl.where(n2 >= k, n2, tl.where(n1 >= k, n1, -1)))
            kth = tl.where(n3 >= k, c3, tl.where(n2 >= k, c2, tl.where(n1 >= k, c1, kth)))
            exact = (met == k).to(tl.int32)
            r += 1
        return kth

    @triton.jit
    def _sample_row(logits, idx, ok, row, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, counters_ptr,
                    counter_offset, V):
        """One row's draw: temperature, top-k, top-p, then the exponential race on its counter-based uniforms."""
        scores = logits / tl.load(temperature_ptr + row) + 0.0  # + 0.0: -0.0 and 0.0 are one score, one key
        # order-preserving uint32 keys: negative floats reversed below positive ones; padding 0, below every score
        # but a NaN's (and kept out by `ok` below)
        bits = scores.to(tl.uint32, bitcast=True)
        key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
        key = tl.where(ok, key, 0)
        k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), V)
        keep = (key >= _top_k_threshold(key, k)) & ok
        top = tl.max(scores, axis=0)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:  # keep an id while the mass strictly above its score is < top_p (the top id always)
            weights = tl.where(keep, tl.exp(scores - top), 0.0)
            probs = weights / tl.sum(weights, axis=0)
            above = tl.zeros([], tl.uint32)  # the largest key whose mass above is still >= top_p
            for i in range(32):  # a loop, not unrolled: the kernel's code stays small (module docstring)
                cand = above | (tl.full([], 1, tl.uint32) << (31 - i))
                mass = tl.sum(tl.where(key > cand, probs, 0.0), axis=0)
                above = tl.where(mass >= top_p, cand, above)
            top_key = tl.max(key, axis=0)
            keep = keep & (key > tl.minimum(above, top_key - 1))
        weights = tl.where(keep, tl.exp(scores - top), 0.0)
        probs = weights / tl.sum(weights, axis=0)
        # the exponential race on uniform_from_counter's uniforms
        counter = tl.load(counters_ptr + row) + counter_offset
        seed_row = _mix32(_mix32(tl.load(seeds_ptr + row).to(tl.uint32)) ^ (counter.to(tl.uint32) * 0x61C88647))
        draws = _mix32(seed_row ^ _mix32(idx.to(tl.uint32) + 0x1E3779B9))
        uniform = (((draws >> 8) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216)
        race = tl.where(probs > 0, probs / -tl.log(uniform), -1.0)
        return tl.argmax(race, axis=0, tie_break_left=True)

    @triton.jit
    def _select_kernel(
        logits_ptr, out_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, counters_ptr,
        counter_offset, stride_row, V, V_P: tl.constexpr, PDL: tl.constexpr,
    ):
        if PDL:  # programmatic dependent launch (stages/pdl.py)
            pdl.begin()
        row = tl.program_id(0)
        idx = tl.arange(0, V_P)
        ok = idx < V
        logits = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf"))
        if tl.load(do_sample_ptr + row) != 0:  # a greedy row runs none of the sampling
            token = _sample_row(logits, idx, ok, row, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, counters_ptr,
                                counter_offset, V)
        else:
            token = tl.argmax(logits, axis=0, tie_break_left=True)
        tl.store(out_ptr + row, token.to(tl.int64))


def select_tokens(
    logits: torch.Tensor, params: SamplingTensors, seeds: torch.Tensor, counters: torch.Tensor, counter_offset: int = 0,
    pdl: bool = False,
) -> torch.Tensor:
    """`stages.sampling.select_tokens` in one kernel: logits [B, V] fp32 -> token ids [B] int64."""
    b, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    assert vocab < 1 << 21, "the top-k rounds count in 21-bit fields"
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    v_p = triton.next_power_of_2(vocab)
    _select_kernel[(b,)](
        logits, out, params.do_sample, params.temperature, params.top_k, params.top_p, seeds, counters, counter_offset,
        logits.stride(0), vocab, V_P=v_p, PDL=pdl, num_warps=8 if v_p >= 4096 else 4, **launch_args(pdl),
    )
    return out
