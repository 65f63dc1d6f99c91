"""TalkerPrompt -> prefill embeddings and trailing text embeddings (the official layouts, §2.3 of the brief).

Each row of the prefill is the sum of a text-track embedding P(x) = text_projection(text_embedding(x))
and a codec-track embedding C(x) = codec_embedding(x). The projections are computed on the same
token groups as the official code so that fp32 results are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.config import ModelConfig
from stages.contract import TalkerPrompt
from stages.talker.model import Talker


@dataclass
class PrefillEmbeds:
    prefill: torch.Tensor  # [L, H] rows of the prompt
    trailing: torch.Tensor  # [T, H] text-track rows added to frames 0..T-1 (then tts_pad)
    tts_pad: torch.Tensor  # [H] text-track row after the trailing text runs out


def _ids(values, device: torch.device) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.long, device=device)  # [1, N]


@torch.no_grad()
def build_prefill(talker: Talker, config: ModelConfig, prompt: TalkerPrompt) -> PrefillEmbeds:
    device = talker.codec_head.weight.device
    dtype = talker.codec_head.weight.dtype
    ids, codec = config.text_ids, config.talker.codec
    P, C = talker.embed_text, talker.embed_codec

    tts_bos, tts_eos, tts_pad = P(_ids([ids.tts_bos, ids.tts_eos, ids.tts_pad], device)).chunk(3, dim=1)  # [1,1,H] each

    parts: list[torch.Tensor] = []
    if prompt.instruct_ids:
        parts.append(P(_ids(prompt.instruct_ids, device)))

    # codec prefix: [think, think_bos, lang, think_eos] or [nothink, think_bos, think_eos]; speaker; [pad, bos]
    prefix = ([codec.nothink, codec.think_bos, codec.think_eos] if prompt.language_id is None
              else [codec.think, codec.think_bos, prompt.language_id, codec.think_eos])
    codec_rows = [C(_ids(prefix, device))]
    if prompt.speaker_id is not None:
        codec_rows.append(C(torch.tensor(prompt.speaker_id, device=device)).view(1, 1, -1))
    elif prompt.voice is not None:
        x_vector = torch.as_tensor(prompt.voice.x_vector, device=device).to(dtype)
        codec_rows.append(x_vector.view(1, 1, -1))
    codec_rows.append(C(_ids([codec.pad, codec.bos], device)))
    codec_block = torch.cat(codec_rows, dim=1)  # [1, N, H]
    n = codec_block.shape[1]

    parts.append(P(_ids(prompt.role_ids, device)))
    parts.append(torch.cat((tts_pad.expand(-1, n - 2, -1), tts_bos), dim=1) + codec_block[:, :-1])

    text = _ids(prompt.text_ids, device)
    if prompt.voice is not None and prompt.voice.icl:
        rows, trailing = _icl_rows(talker, config, prompt, text, tts_pad, tts_eos)
        parts.append(rows)
    elif prompt.non_streaming_text:
        pad_codes = C(_ids([codec.pad] * (text.shape[1] + 1), device))
        parts.append(torch.cat((P(text), tts_eos), dim=1) + pad_codes)
        parts.append(tts_pad + C(_ids([codec.bos], device)))
        trailing = tts_pad
    else:
        parts.append(P(text[:, :1]) + codec_block[:, -1:])
        trailing = torch.cat((P(text[:, 1:]), tts_eos), dim=1)
    prefill = torch.cat(parts, dim=1)
    return PrefillEmbeds(prefill=prefill[0], trailing=trailing[0], tts_pad=tts_pad[0, 0])


def _icl_rows(
    talker: Talker, config: ModelConfig, prompt: TalkerPrompt, text: torch.Tensor,
    tts_pad: torch.Tensor, tts_eos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """In-context voice clone: reference transcript + target text against reference codes."""
    device = text.device
    codec = config.talker.codec
    assert prompt.voice is not None and prompt.voice.ref_codes is not None and prompt.voice.ref_text_ids
    ref_text = _ids(prompt.voice.ref_text_ids, device)
    text_block = torch.cat((talker.embed_text(torch.cat((ref_text, text), dim=-1)), tts_eos), dim=1)  # [1, T1, H]
    ref_codes = torch.as_tensor(prompt.voice.ref_codes, dtype=torch.long, device=device)  # [T_ref, 16]
    code_block = torch.cat(
        (talker.embed_codec(_ids([codec.bos], device)), talker.embed_frame_codes(ref_codes)[None]), dim=1
    )  # [1, T2, H]
    t1, t2 = text_block.shape[1], code_block.shape[1]
    if prompt.non_streaming_text:
        pads = talker.embed_codec(_ids([codec.pad] * t1, device))
        return torch.cat((text_block + pads, code_block + tts_pad), dim=1), tts_pad
    if t1 > t2:
        return text_block[:, :t2] + code_block, text_block[:, t2:]
    padded = torch.cat([text_block] + [tts_pad] * (t2 - t1), dim=1)
    return padded + code_block, tts_pad


