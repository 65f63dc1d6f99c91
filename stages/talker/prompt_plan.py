"""A prompt as ids (host, numpy), and its embedding on the device from those ids (no host sync).

`build_prefill` (stages/talker/prefill.py) embeds a prompt with the official token groups, which makes
fp32 results bit-identical to the official package; it is the reference path. The engine's fast path
cannot afford its per-request eager kernels and pageable copies, so it describes every prompt row by ids:

    row = P(text_id) + [C(codec_id) | x-vector | sum of the 16 codebook embeddings of a reference frame]

(any part may be absent), and the trailing text rows (fed one per frame) as text ids. The ids of a whole
admission batch cross to the device in one staged copy, and `embed_rows` turns them into embeddings inside
the captured prefill graph. The math per row is the same as `build_prefill`'s; the token grouping of the
text projection differs, so results agree to float rounding (tests/stages/test_prompt_plan.py), not bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stages.config import ModelConfig
from stages.contract import NUM_CODEBOOKS, TalkerPrompt
from stages.talker.model import Talker

NONE = -1  # "no id" in a plan's id arrays


@dataclass(frozen=True)
class PromptPlan:
    """Rows of one prompt's prefill and trailing text, as ids."""

    text_ids: np.ndarray  # [L] int64: text-track id of each prefill row, NONE for none
    codec_ids: np.ndarray  # [L] int64: codec-track id of each row, NONE for none
    ref_frames: np.ndarray  # [L] int64: index into ref_codes whose frame embedding the row adds, NONE for none
    ref_codes: np.ndarray | None  # [T_ref, 16] int64 (Base ICL)
    x_vector_row: int  # row that adds the x-vector (Base), NONE for none
    x_vector: np.ndarray | None  # [H] float32
    trailing_ids: np.ndarray  # [T] int64: text ids added to frames 0..T-1 (then tts_pad)

    @property
    def length(self) -> int:
        return int(self.text_ids.shape[0])

    @property
    def trailing_length(self) -> int:
        return int(self.trailing_ids.shape[0])


class _Rows:
    """Appends rows (text id, codec id, reference frame index) in order."""

    def __init__(self) -> None:
        self.text: list[int] = []
        self.codec: list[int] = []
        self.frame: list[int] = []

    def add(self, text: list[int], codec: list[int] | None = None, frame: list[int] | None = None) -> None:
        n = len(text)
        self.text += text
        self.codec += codec if codec is not None else [NONE] * n
        self.frame += frame if frame is not None else [NONE] * n


def plan_prompt(config: ModelConfig, prompt: TalkerPrompt) -> PromptPlan:
    """The rows `build_prefill` makes for `prompt`, as ids (see its layouts, §2.3 of the model brief)."""
    ids, codec = config.text_ids, config.talker.codec
    pad, bos, eos = ids.tts_pad, ids.tts_bos, ids.tts_eos
    rows = _Rows()
    if prompt.instruct_ids:
        rows.add(list(prompt.instruct_ids))
    # codec block: prefix; speaker (id or x-vector); [pad, bos]. Its last row (bos) joins the first text row.
    prefix = ([codec.nothink, codec.think_bos, codec.think_eos] if prompt.language_id is None
              else [codec.think, codec.think_bos, prompt.language_id, codec.think_eos])
    block = [*prefix]
    x_vector_at = NONE
    if prompt.speaker_id is not None:
        block.append(prompt.speaker_id)
    elif prompt.voice is not None:
        x_vector_at = len(block)
        block.append(NONE)
    block += [codec.pad, codec.bos]
    n = len(block)
    rows.add(list(prompt.role_ids))
    x_vector_row = NONE if x_vector_at == NONE else len(rows.text) + x_vector_at
    rows.add([pad] * (n - 2) + [bos], block[:-1])

    text = list(prompt.text_ids)
    voice = prompt.voice
    if voice is not None and voice.icl:
        assert voice.ref_codes is not None and voice.ref_text_ids is not None
        text_block = list(voice.ref_text_ids) + text + [eos]  # t1 rows
        n_ref = int(voice.ref_codes.shape[0])
        code_codec = [codec.bos] + [NONE] * n_ref  # t2 rows: C(bos), then reference frames
        code_frame = [NONE] + list(range(n_ref))
        t1, t2 = len(text_block), n_ref + 1
        if prompt.non_streaming_text:
            rows.add(text_block, [codec.pad] * t1)
            rows.add([pad] * t2, code_codec, code_frame)
            trailing = [pad]
        elif t1 > t2:
            rows.add(text_block[:t2], code_codec, code_frame)
            trailing = text_block[t2:]
        else:
            rows.add(text_block + [pad] * (t2 - t1), code_codec, code_frame)
            trailing = [pad]
    elif prompt.non_streaming_text:
        rows.add(text + [eos], [codec.pad] * (len(text) + 1))
        rows.add([pad], [codec.bos])
        trailing = [pad]
    else:
        rows.add(text[:1], [codec.bos])
        trailing = text[1:] + [eos]

    def arr(values: list[int]) -> np.ndarray:
        return np.asarray(values, dtype=np.int64)

    return PromptPlan(
        text_ids=arr(rows.text), codec_ids=arr(rows.codec), ref_frames=arr(rows.frame),
        ref_codes=None if voice is None or not voice.icl else np.asarray(voice.ref_codes, dtype=np.int64),
        x_vector_row=x_vector_row,
        x_vector=None if x_vector_row == NONE else np.asarray(voice.x_vector, dtype=np.float32),
        trailing_ids=arr(trailing),
    )


def embed_rows(
    talker: Talker,
    text_ids: torch.Tensor,  # [B, W] int64, NONE = no text part
    codec_ids: torch.Tensor,  # [B, W] int64, NONE = no codec id
    frame_codes: torch.Tensor,  # [B, W, 16] int64: a reference frame's codes per row (any where unused)
    frame_mask: torch.Tensor,  # [B, W] bool: the row adds its frame's embedding
    x_vectors: torch.Tensor,  # [B, H] (zeros where unused)
    x_vector_row: torch.Tensor,  # [B] int64, NONE = none
) -> torch.Tensor:
    """Prompt rows from ids -> [B, W, H]. Shape-static and sync-free: runs inside the prefill graph.

    Absent parts contribute exact zeros, so a row's value is the sum of its present parts, as in
    `build_prefill`.
    """
    width = text_ids.shape[1]
    text = talker.embed_text(text_ids.clamp(min=0)) * (text_ids >= 0)[..., None]
    codec = talker.embed_codec(codec_ids.clamp(min=0)) * (codec_ids >= 0)[..., None]
    frames = talker.embed_frame_codes(frame_codes) * frame_mask[..., None]
    at = torch.arange(width, device=text_ids.device)[None, :] == x_vector_row[:, None]  # [B, W]
    x_vector = x_vectors[:, None, :].to(text.dtype) * at[..., None]
    return text + codec + frames + x_vector


def embed_text_rows(talker: Talker, ids: torch.Tensor, fixed_width: int = 0) -> torch.Tensor:
    """Trailing text rows: P(ids) for ids [B, T] (NONE rows give zeros, never read).

    `fixed_width` (deterministic mode; T a multiple of it): each row's T ids are projected in products of exactly
    [1, fixed_width] rows, one after the other, so a text row's value never depends on how many rows (or requests)
    were projected with it: the GEMM's kernel and its rounding follow its row count."""
    if not fixed_width or not ids.shape[1]:  # (no rows: the plain product of none)
        return talker.embed_text(ids.clamp(min=0)) * (ids >= 0)[..., None]
    b, t = ids.shape
    padded = torch.nn.functional.pad(ids, (0, -t % fixed_width), value=NONE)  # NONE rows: zeros, never read
    rows = [embed_text_rows(talker, padded[i:i + 1, j:j + fixed_width])
            for i in range(b) for j in range(0, padded.shape[1], fixed_width)]
    return torch.cat(rows, 1).view(b, padded.shape[1], -1)[:, :t]


def frame_codes_of(plan: PromptPlan) -> np.ndarray:
    """[L, 16] codes of the reference frame each row adds (zeros where none)."""
    out = np.zeros((plan.length, NUM_CODEBOOKS), dtype=np.int64)
    if plan.ref_codes is not None:
        rows = np.nonzero(plan.ref_frames >= 0)[0]
        out[rows] = plan.ref_codes[plan.ref_frames[rows]]
    return out
