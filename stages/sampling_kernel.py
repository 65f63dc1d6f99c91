"""`select_tokens` (stages/sampling.py) as one Triton program per row: temperature, top-k, top-p and the draw
without sorting the vocabulary.

The compiled `select_tokens` sorts every row (for the k-th largest score and top-p's cumulative mass) and runs
5-6 more kernels around the sort; a frame samples 16 times (codebook 0, then the code predictor's 15), and on the
H100 the radix sorts alone took 0.33 ms of the 6.8 ms batch-1 step (`docs/benchmarks.md`, "Fewer kernels per
frame"). Here the row stays in registers and both thresholds are found by bisection on the scores' bits:
- each fp32 score maps to an order-preserving 32-bit key; the k-th largest key is built bit by bit from the top
  (32 counts of `key >= candidate`), and top-k keeps `key >= kth` (ties at the boundary kept, as the sort does);
- top-p (only for rows with top_p < 1) keeps an id while the probability mass strictly above its score is below
  top_p, which is what `mass_before < top_p` over the sorted row means: the largest key whose mass above is
  still >= top_p is found the same way (32 masked sums), and the ids above it stay;
- the draw is the same exponential race on the same counter-based uniforms (`uniform_from_counter`'s hash in
  int64), so a seeded request draws the same ids as with `select_tokens`, up to the summation order of the
  softmax (a race decided by less than that rounding may go the other way).
"""

from __future__ import annotations

import torch

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
        """stages/sampling._mix32 on int64 values (< 2**32 after every step, products < 2**63)."""
        x = x & 0xFFFFFFFF
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x = x ^ (x >> 12)
        x = (x * 0x297A2D39) & 0xFFFFFFFF
        return x ^ (x >> 15)

    @triton.jit
    def _select_kernel(
        logits_ptr, out_ptr, do_sample_ptr, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, counters_ptr,
        stride_row, V, V_P: tl.constexpr,
    ):
        row = tl.program_id(0)
        idx = tl.arange(0, V_P)
        ok = idx < V
        logits = tl.load(logits_ptr + row * stride_row + idx, mask=ok, other=float("-inf"))
        greedy = tl.argmax(logits, axis=0, tie_break_left=True)
        scores = logits / tl.load(temperature_ptr + row) + 0.0  # + 0.0: -0.0 and 0.0 are one score, one key
        # order-preserving keys: negative floats reversed below positive ones; padding (-1) below every score
        bits = scores.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
        key = tl.where(ok, key, -1)
        # top-k: the k-th largest key, from the top bit down (ties at the boundary are kept)
        k = tl.minimum(tl.maximum(tl.load(top_k_ptr + row), 1), V)
        kth = tl.zeros([], tl.int64)
        # 1 bit a round: 32 counts of key >= candidate (a radix select, 4 rounds of an 8-bit tl.histogram, found the
        # same threshold 1.3-1.5x slower on the H100: docs/benchmarks.md, "Few-row GEMVs on by default")
        for i in tl.static_range(32):
            cand = kth | (1 << (31 - i))
            kth = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= k, cand, kth)
        keep = key >= kth
        top = tl.max(scores, axis=0)
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:  # keep an id while the mass strictly above its score is < top_p (the top id always)
            weights = tl.where(keep, tl.exp(scores - top), 0.0)
            probs = weights / tl.sum(weights, axis=0)
            above = tl.zeros([], tl.int64)  # the largest key whose mass above is still >= top_p
            for i in tl.static_range(32):
                cand = above | (1 << (31 - i))
                mass = tl.sum(tl.where(key > cand, probs, 0.0), axis=0)
                above = tl.where(mass >= top_p, cand, above)
            top_key = tl.max(key, axis=0)
            keep = keep & (key > tl.minimum(above, top_key - 1))
        weights = tl.where(keep, tl.exp(scores - top), 0.0)
        probs = weights / tl.sum(weights, axis=0)
        # the exponential race on uniform_from_counter's uniforms
        seed_row = _mix32(_mix32(tl.load(seeds_ptr + row)) ^ ((tl.load(counters_ptr + row) * 0x61C88647) & 0xFFFFFFFF))
        draws = _mix32(seed_row ^ _mix32(idx.to(tl.int64) + 0x1E3779B9))
        uniform = (((draws >> 8) & 0xFFFFFF).to(tl.float32) + 0.5) * (1.0 / 16777216)
        race = tl.where(probs > 0, probs / -tl.log(uniform), -1.0)
        sampled = tl.argmax(race, axis=0, tie_break_left=True)
        token = tl.where(tl.load(do_sample_ptr + row) != 0, sampled, greedy)
        tl.store(out_ptr + row, token.to(tl.int64))


def select_tokens(
    logits: torch.Tensor, params: SamplingTensors, seeds: torch.Tensor, counters: torch.Tensor
) -> torch.Tensor:
    """`stages.sampling.select_tokens` in one kernel: logits [B, V] fp32 -> token ids [B] int64."""
    b, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    v_p = triton.next_power_of_2(vocab)
    _select_kernel[(b,)](
        logits, out, params.do_sample, params.temperature, params.top_k, params.top_p, seeds, counters,
        logits.stride(0), vocab, V_P=v_p, num_warps=8 if v_p >= 4096 else 4,
    )
    return out
