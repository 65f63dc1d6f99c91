"""Decoding chunks in one plain forward of the decoder, for the tests: the reference the engine is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.code2wav.model import Code2WavDecoder


def decode_chunks(
    decoder: Code2WavDecoder, chunks: list[tuple[torch.Tensor, int]]
) -> list[torch.Tensor]:  # chunks: (codes [ctx + new, K] int, ctx) -> per chunk wav [new * 1920]
    """Decode many streams' chunks in one forward (reference path; the engine adds buckets and graphs).

    Each chunk is `(codes, ctx)`: its first `ctx` frames are left context already played out (they only
    condition the new frames), the rest are new. Chunks are right-padded with code 0 to a common length;
    padding never reaches the real frames because every layer is causal. Each chunk gets back the
    samples of its new frames, `wav[ctx * 1920 : len * 1920]`.
    """
    if not chunks:
        return []
    for codes, ctx in chunks:
        if codes.ndim != 2 or not 0 <= ctx < codes.shape[0]:
            raise ValueError(f"bad chunk: codes {tuple(codes.shape)} with ctx={ctx} (need [ctx + new >= 1, K])")
    max_len = max(codes.shape[0] for codes, _ in chunks)
    batch = torch.stack([F.pad(codes.T, (0, max_len - codes.shape[0])) for codes, _ in chunks])  # [B, K, T_max]
    wav = decoder(batch)[:, 0]  # [B, T_max * 1920]
    spf = decoder.samples_per_frame
    return [wav[i, ctx * spf : codes.shape[0] * spf] for i, (codes, ctx) in enumerate(chunks)]
