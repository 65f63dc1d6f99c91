"""One codec frame, batched: the code-predictor loop for codebooks 1..15 and the next talker input.

Shared by the reference generator and the engine (eager and CUDA-graph paths), so there is exactly
one implementation of the per-frame math. Shape-static, no host sync: graph-capturable.
"""

from __future__ import annotations

import torch

from stages.contract import NUM_CODEBOOKS
from stages.sampling import SamplingTensors, select_tokens
from stages.talker.contiguous_kv import ContiguousKV
from stages.talker.model import Talker
from stages.talker.paged_attention import DecodeTiling


def new_code_predictor_cache(talker: Talker, batch: int, pdl: bool = False,
                             tiling: DecodeTiling | None = None) -> ContiguousKV:
    """`pdl`: its decode kernel launches with programmatic dependent launch (stages/pdl.py); `tiling`: the kernel's
    (None: by the batch)."""
    cp = talker.config.code_predictor.transformer
    w = talker.codec_head.weight
    return ContiguousKV(cp.num_hidden_layers, batch, cp.num_key_value_heads, cp.head_dim, NUM_CODEBOOKS,
                        dtype=w.dtype, device=w.device, pdl=pdl, tiling=tiling)


def predict_frame_codes(
    talker: Talker,
    hidden: torch.Tensor,  # [B, H] talker post-norm hidden state of the step that produced c0
    c0: torch.Tensor,  # [B] codebook-0 codes
    cache: ContiguousKV,  # [B]-row cache with 16 positions, reset here
    params: SamplingTensors,  # sub-talker sampling parameters
    seeds: torch.Tensor,  # [B] int64
    frame_index: torch.Tensor,  # [B] int64, index of this frame in its request (RNG counter)
    select=select_tokens,  # token selection (the engine may pass a compiled version)
    counters: torch.Tensor | None = None,  # frame_index * 16 if the caller has it already
) -> torch.Tensor:
    """-> codes [B, 16] of the frame (c0 first)."""
    cp = talker.code_predictor
    cache.reset()
    inputs = torch.stack((hidden, talker.embed_codec(c0)), dim=1)  # [B, 2, H]
    positions = slice(0, 2)  # the same for every row: RoPE's rows are a view of its table (no kernel per pass)
    if counters is None:  # pass g draws with counters + g + 1 (an int: no kernel per pass)
        counters = frame_index * NUM_CODEBOOKS
    codes = [c0]
    for group in range(NUM_CODEBOOKS - 1):
        cache.begin(inputs.shape[1])
        logits = cp.forward_step(inputs, positions, cache, group).float()
        cache.advance()
        code = select(logits, params, seeds, counters, group + 1)
        codes.append(code)
        if group < NUM_CODEBOOKS - 2:
            inputs = cp.pass_inputs(code, group)  # [B, 1, H] (projected already on the few-row path)
            positions = slice(group + 2, group + 3)
    return torch.stack(codes, dim=1)


def next_talker_input(
    talker: Talker,
    codes: torch.Tensor,  # [B, 16]
    text_rows: torch.Tensor,  # [B, H] trailing text row of this frame (or tts_pad)
) -> torch.Tensor:
    """-> [B, 1, H]: sum of the frame's 16 codebook embeddings plus the text-track row."""
    return (talker.embed_frame_codes(codes) + text_rows)[:, None]


def step_talker_input(
    talker: Talker,
    codes: torch.Tensor,  # [B, 16] this frame's codes
    frame_index: torch.Tensor,  # [B] index of this frame in its request
    trailing: torch.Tensor,  # [B, T, H] each row's trailing text rows
    trailing_len: torch.Tensor,  # [B] how many of them it has
    tts_pad: torch.Tensor,  # [H] the text track once a row's text is used up
) -> torch.Tensor:
    """-> [B, 1, H]: the engine's next talker input for each row, with the row's trailing text row of this frame.
    Pure indexing and one sum: the compiled engine runs it as one or two kernels instead of a dozen."""
    has_text = frame_index < trailing_len
    text_idx = torch.minimum(frame_index, (trailing_len - 1).clamp(min=0))
    text_rows = trailing.gather(1, text_idx[:, None, None].expand(-1, 1, trailing.shape[-1]))[:, 0]
    return next_talker_input(talker, codes, torch.where(has_text[:, None], text_rows, tts_pad[None, :]))


def advance_rows(
    positions: torch.Tensor,  # [B] next KV position, advanced in place (saturating at max_position)
    frame_index: torch.Tensor,  # [B] advanced in place
    seen: torch.Tensor,  # [B, vocab] codebook-0 codes seen so far (repetition penalty): c0 marked in place
    c0: torch.Tensor,  # [B] this frame's codebook-0 code
    max_position: int,
) -> None:
    """The rows' bookkeeping after a talker step, in place. Padding rows (free rows) also advance; saturating keeps
    their writes inside their (scratch) table."""
    seen.scatter_(1, c0[:, None], True)
    positions.copy_((positions + 1).clamp(max=max_position))
    frame_index.add_(1)


def record_step(
    out: torch.Tensor,  # [B, 17] the step's output: this frame's 16 codes (written by the step's first half)
    c0: torch.Tensor,  # [B] replaced by next_c0
    next_c0: torch.Tensor,  # [B]
) -> None:
    """The step's second half ends here: the next frame's codebook-0 code, in the output and as the next input."""
    out[:, NUM_CODEBOOKS] = next_c0
    c0.copy_(next_c0)
