"""Qwen3-ForcedAligner in plain PyTorch: the audio tower, the Qwen3 text decoder and the timestamp head.

One non-autoregressive forward: the prompt `<|audio_start|> <|audio_pad|> x n <|audio_end|> word <timestamp>
<timestamp> word ...` is embedded, the audio tower's tokens replace the `<|audio_pad|>` embeddings, a causal pass of
the decoder runs over it, and the head classifies every position into `classify_num` classes of
`timestamp_segment_time` ms. Parameter names are the official ones under `thinker.`; the decoder is the project's
Qwen3 stack (stages/layers.py): the official "interleaved M-RoPE" with three equal position rows is plain RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stages.aligner.audio_encoder import AudioEncoder
from stages.aligner.config import AlignerConfig
from stages.layers import DecoderStack


@dataclass
class PaddedPromptAttention:
    """The `AttentionContext` of one prefill over left-padded prompts: causal over each row's real tokens. A padding
    query attends to itself only (its output is never read), so no row of the mask is empty."""

    mask: torch.Tensor  # [B, 1, S, S] bool, True = may attend
    is_causal: bool = False

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> PaddedPromptAttention:
        s = attention_mask.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=attention_mask.device).tril()
        keys = attention_mask.bool()[:, None, None, :]
        eye = torch.eye(s, dtype=torch.bool, device=attention_mask.device)
        return cls(mask=(causal & keys) | eye)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


class TextModel(DecoderStack):
    """`thinker.model.*`: token embeddings + the Qwen3 decoder layers + final norm."""

    def __init__(self, cfg: AlignerConfig):
        super().__init__(cfg.text)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.text.hidden_size)


class ForcedAligner(nn.Module):
    def __init__(self, cfg: AlignerConfig):
        super().__init__()
        self.config = cfg
        self.audio_tower = AudioEncoder(cfg.audio)
        self.model = TextModel(cfg)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.classify_num, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, features: torch.Tensor,
                frames: list[int]) -> torch.Tensor:
        """input_ids/attention_mask [B, S] (left-padded; row i holds conv_output_frames(frames[i]) audio tokens),
        features [B, mel, T] -> timestamp logits [B, S, classify_num] (padding positions hold garbage)."""
        dtype = self.lm_head.weight.dtype
        audio = torch.cat(self.audio_tower(features.to(dtype), frames))
        x = self.model.embed_tokens(input_ids)
        audio_slots = input_ids == self.config.audio_token_id
        if int(audio_slots.sum()) != audio.shape[0]:
            raise ValueError(f"the prompts hold {int(audio_slots.sum())} audio slots for {audio.shape[0]} audio tokens")
        x = x.masked_scatter(audio_slots[..., None], audio.to(x.dtype))
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        hidden = self.model(x, positions, PaddedPromptAttention.of(attention_mask))
        return self.lm_head(hidden)
