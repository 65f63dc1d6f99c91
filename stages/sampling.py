"""Token selection on the device, batched, with per-row parameters and per-row counter-based randomness.

Semantics follow the official (Hugging Face) logits pipeline: repetition penalty -> min-length EOS
mask -> suppressed ids -> (if sampling) temperature -> top-k -> top-p -> draw. Greedy rows take the
argmax after the first three steps.

Randomness is a pure function of (seed, counter, vocab index), not a shared generator, so a seeded
request draws the same tokens whatever else is in the batch and whichever graph bucket runs it. A
draw is `argmax(p / E)` with E ~ Exp(1) per vocab entry (the exponential race), which picks token i
with probability p_i, like `torch.multinomial`. All ops are shape-static: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.contract import SamplingParams

_MASK32 = 0xFFFFFFFF
TOP_K_OFF = 1 << 30  # top_k 0 means "off": a k this large keeps every id


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) computed in int64 without overflow.

    Values stay < 2**32 and multipliers < 2**31, so every product fits in a signed 64-bit int.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    return x ^ (x >> 15)


def uniform_from_counter(seeds: torch.Tensor, counters: torch.Tensor, width: int) -> torch.Tensor:
    """Uniform(0, 1) floats [B, width] from per-row seeds [B] and counters [B] (int64)."""
    idx = torch.arange(width, device=seeds.device, dtype=torch.int64)
    row = _mix32(_mix32(seeds) ^ ((counters * 0x61C88647) & _MASK32))  # [B]
    bits = _mix32(row[:, None] ^ _mix32(idx + 0x1E3779B9)[None, :])  # [B, width]; constants < 2**31 (Triton int32)
    # top 24 bits; the mask keeps the value in [0, 2**24) even if a backend wrapped the hash arithmetic
    return (((bits >> 8) & 0xFFFFFF).float() + 0.5) * (1.0 / (1 << 24))  # strictly inside (0, 1)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors [B] (built once per batch composition)."""

    do_sample: torch.Tensor  # bool
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; >= vocab disables
    top_p: torch.Tensor  # float32; 1.0 disables


@dataclass
class SamplingRows:
    """`SamplingParams` of a batch's rows as [rows]-shaped device tensors: what the sampling functions take."""

    talker: SamplingTensors
    sub: SamplingTensors
    penalty: torch.Tensor  # float32
    min_frames: torch.Tensor  # int64
    suppress_eos: torch.Tensor  # bool

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> SamplingRows:
        def t(values, dtype):
            return torch.tensor(list(values), dtype=dtype, device=device)

        return cls(
            talker=SamplingTensors(t((p.do_sample for p in params), torch.bool),
                                   t((p.temperature for p in params), torch.float32),
                                   t((p.top_k or TOP_K_OFF for p in params), torch.long),
                                   t((p.top_p for p in params), torch.float32)),
            sub=SamplingTensors(t((p.subtalker_do_sample for p in params), torch.bool),
                                t((p.subtalker_temperature for p in params), torch.float32),
                                t((p.subtalker_top_k or TOP_K_OFF for p in params), torch.long),
                                t((p.subtalker_top_p for p in params), torch.float32)),
            penalty=t((p.repetition_penalty for p in params), torch.float32),
            min_frames=t((p.min_frames for p in params), torch.long),
            suppress_eos=t((p.suppress_eos for p in params), torch.bool),
        )


def suppressed_ids_mask(vocab_size: int, codebook_size: int, eos_id: int, device: torch.device) -> torch.Tensor:
    """[V] bool: control ids (>= codebook size) except EOS can never be sampled."""
    mask = torch.arange(vocab_size, device=device) >= codebook_size
    mask[eos_id] = False
    return mask


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Penalize ids already generated (`seen` [B, V] bool) once each: s<0 ? s*p : s/p."""
    penalized = torch.where(logits < 0, logits * penalty[:, None], logits / penalty[:, None])
    return torch.where(seen, penalized, logits)


def select_tokens(
    logits: torch.Tensor, params: SamplingTensors, seeds: torch.Tensor, counters: torch.Tensor, counter_offset: int = 0
) -> torch.Tensor:
    """logits [B, V] fp32 (already penalized/masked) -> token ids [B] int64, drawn with the uniforms of counters
    + counter_offset (an int, so that a frame's 16 draws share one counter tensor)."""
    greedy = logits.argmax(dim=-1)
    vocab = logits.shape[-1]
    scores = logits / params.temperature[:, None]
    # top-k: keep every score >= the k-th largest (ties at the boundary kept, as in HF)
    sorted_scores, _ = scores.sort(dim=-1, descending=True)
    k = params.top_k.clamp(min=1, max=vocab)
    kth = sorted_scores.gather(1, (k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # top-p: keep the smallest prefix (by descending probability) whose mass reaches top_p
    probs_sorted = torch.softmax(sorted_scores.masked_fill(sorted_scores < kth, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    keep_sorted = mass_before < params.top_p[:, None]
    keep_sorted[:, 0] = True
    # the threshold score: the smallest kept sorted score; everything below it is dropped
    last_kept = keep_sorted.sum(dim=-1, keepdim=True) - 1
    threshold = sorted_scores.gather(1, last_kept)
    scores = scores.masked_fill(scores < threshold, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    race = probs / -torch.log(uniform_from_counter(seeds, counters + counter_offset if counter_offset else counters, vocab))
    # a dropped id (probability 0) can never win, not even against a NaN race value
    sampled = torch.where(probs > 0, race, -1.0).argmax(dim=-1)
    return torch.where(params.do_sample, sampled, greedy)


def mask_talker_logits(
    logits: torch.Tensor,
    seen: torch.Tensor,
    penalty: torch.Tensor,
    frames_done: torch.Tensor,
    min_frames: torch.Tensor,
    suppress: torch.Tensor,
    eos_id: int,
    suppress_eos: torch.Tensor,
) -> torch.Tensor:
    """The talker's logits processors, in Hugging Face order, on fp32 logits [B, V].

    1. repetition penalty over previously generated codebook-0 ids (`seen` [B, V]);
    2. EOS masked while fewer than `min_frames` tokens were sampled (and always if `suppress_eos`);
    3. control ids (`suppress` [V] bool: 2048..3071 except EOS) masked.
    """
    logits = apply_repetition_penalty(logits, seen, penalty)
    block_eos = (frames_done < min_frames) | suppress_eos  # [B]
    eos_col = logits[:, eos_id].masked_fill(block_eos, float("-inf"))
    logits = logits.masked_fill(suppress[None, :], float("-inf"))
    return torch.cat((logits[:, :eos_id], eos_col[:, None], logits[:, eos_id + 1:]), dim=1)
