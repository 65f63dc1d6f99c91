"""Runs under Triton's interpreter (tests/triton_interpreter.py): `stages.sampling_kernel.select_tokens` against
`stages.sampling.select_tokens` on the same rows, parameters, seeds and counters. Prints the counts as JSON."""

from __future__ import annotations

import itertools
import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch

from stages import sampling, sampling_kernel
from stages.sampling import TOP_K_OFF, SamplingTensors


def rows(vocab: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    grid = list(itertools.product((True, False), (0.5, 0.9, 1.3), (1, 5, 50, vocab, TOP_K_OFF), (1.0, 0.9, 0.5, 0.02)))
    b = len(grid)
    logits = torch.randn(b, vocab, generator=gen) * 3
    logits[:, vocab - vocab // 4:] = float("-inf")  # masked ids (control codes, suppressed EOS)
    logits[::3, 7:40] = logits[::3, 7:8]  # ties, some at the top-k boundary
    many_ties = torch.arange(b) % 5 == 1
    logits[many_ties] = logits[many_ties].round()  # many ties
    params = SamplingTensors(torch.tensor([g[0] for g in grid]), torch.tensor([g[1] for g in grid]),
                             torch.tensor([g[2] for g in grid]), torch.tensor([g[3] for g in grid]))
    seeds = torch.randint(0, 2**40, (b,), generator=gen)
    counters = torch.randint(0, 2**20, (b,), generator=gen)
    ref = sampling.select_tokens(logits, params, seeds, counters)
    got = sampling_kernel.select_tokens(logits, params, seeds, counters)
    # the same draws from counters given as a tensor and an int offset (a frame's passes share one tensor)
    offset = sampling_kernel.select_tokens(logits, params, seeds, counters - 7, 7)
    kept = torch.isfinite(logits.gather(1, got[:, None]))[:, 0]
    return {"rows": b, "equal": int((ref == got).sum()), "offset_equal": int((offset == got).sum()),
            "sampled_rows": int(params.do_sample.sum()),
            "finite_choice": int(kept.sum()), "distinct_tokens": len(set(got.tolist()))}


if __name__ == "__main__":
    print(json.dumps({f"vocab{v}_seed{s}": rows(v, s) for v, s in ((2048, 0), (3072, 1))}))
