"""Qwen3-ForcedAligner in plain PyTorch: the audio tower, the Qwen3 text decoder and the timestamp head.

One non-autoregressive forward: the prompt `<|audio_start|> <|audio_pad|> x n <|audio_end|> word <timestamp>
<timestamp> word ...` is embedded, the audio tower's tokens replace the `<|audio_pad|>` embeddings, a causal pass of
the decoder runs over it, and the head classifies every position into `classify_num` classes of
`timestamp_segment_time` ms. Parameter names are the official ones under `thinker.`; the decoder is the project's
Qwen3 stack (stages/layers.py): the official "interleaved M-RoPE" with three equal position rows is plain RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from stages.aligner.audio_encoder import AudioEncoder
from stages.aligner.config import AlignerConfig
from stages.layers import DecoderStack, LayerKernels


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
                frames: list[int], runners: LayerRunners | None = None) -> torch.Tensor:
        """input_ids/attention_mask [B, S] (left-padded; row i holds conv_output_frames(frames[i]) audio tokens),
        features [B, mel, T] -> timestamp logits [B, S, classify_num] (padding positions hold garbage). `runners`:
        how the two transformers' layers run (stages/aligner/graphs.py replays them as CUDA graphs); eager
        without."""
        dtype = self.lm_head.weight.dtype
        tower_layers = runners.tower_layers if runners is not None else None
        audio = torch.cat(self.audio_tower(features.to(dtype), frames, tower_layers))
        x = self.model.embed_tokens(input_ids)
        audio_slots = input_ids == self.config.audio_token_id
        if int(audio_slots.sum()) != audio.shape[0]:
            raise ValueError(f"the prompts hold {int(audio_slots.sum())} audio slots for {audio.shape[0]} audio tokens")
        x = x.masked_scatter(audio_slots[..., None], audio.to(x.dtype))
        if runners is not None:
            return runners.decode(x, attention_mask)
        return self.decode(x, attention_mask)

    def compile_kernels(self) -> None:
        """Both transformers' layer math as `torch.compile`d functions (dynamic shapes: one compile for every
        batch and length): the text decoder takes the engines' `LayerKernels` over fused q/k/v and gate/up
        products, the audio tower one compiled layer function. Most of an eager forward's GPU time is the
        elementwise work between the products (norms in fp32, RoPE, activations, residuals), which these fuse;
        on a GPU the CUDA graphs (stages/aligner/graphs.py) replay the compiled kernels."""
        self.model.fuse_projections()
        self.model.kernels = LayerKernels.compiled()
        self.audio_tower.compile_layers()

    def decode(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The prompt's embeddings x [B, S, H] (audio in place) -> timestamp logits [B, S, classify_num]."""
        return self.lm_head(self.hidden_states(x, attention_mask))

    def hidden_states(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The decoder's output [B, S, H] (before the head)."""
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        return self.model(x, positions, PaddedPromptAttention.of(attention_mask))


class LayerRunners(Protocol):
    def tower_layers(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        """The audio tower's transformer layers: x [N, L, d], key_mask [N, 1, 1, L] -> [N, L, d]."""

    def decode(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """`ForcedAligner.decode`."""
