"""The talker LM (codebook 0) and the code predictor (codebooks 1..15): modules and their math.

State-dict names equal the official checkpoint's under the `talker.` prefix. These modules only
compute; caching, batching and sampling are decided by their callers (reference generator, engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages import gemv_kernels
from stages.config import TalkerConfig
from stages.layers import AttentionContext, DecoderStack, stack_as_views


class TextProjection(nn.Module):
    """Maps text-embedding space into the talker's hidden size: fc2(silu(fc1(x)))."""

    def __init__(self, in_dim: int, hidden: int, out_dim: int):
        super().__init__()
        self.linear_fc1 = nn.Linear(in_dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, out_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerBackbone(DecoderStack):
    """`talker.model`: the decoder stack plus the codec and text embedding tables."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__(cfg.transformer)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)


class CodePredictorBackbone(DecoderStack):
    """`talker.code_predictor.model`: 15 embedding tables (talker width) feeding a small stack."""

    def __init__(self, cfg: TalkerConfig):
        cp = cfg.code_predictor
        super().__init__(cp.transformer)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cp.vocab_size, cfg.hidden_size) for _ in range(cp.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    """Predicts codebooks 1..15 of a frame from the talker's hidden state and codebook 0.

    Sequence per frame (positions 0..15, fresh cache every frame):
    prefill rows [h, C(c0)] -> lm_head[0] -> c1; then row E_{j-1}(c_{j-1}) -> lm_head[j-1] -> c_j.
    """

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        cp = cfg.code_predictor
        self.model = CodePredictorBackbone(cfg)
        self.lm_head = nn.ModuleList(
            nn.Linear(cp.transformer.hidden_size, cp.vocab_size, bias=False) for _ in range(cp.num_code_groups - 1)
        )
        if cp.transformer.hidden_size != cfg.hidden_size:
            self.small_to_mtp_projection: nn.Module = nn.Linear(cfg.hidden_size, cp.transformer.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        # codec_embedding[g] through the input projection, per id (`project_codec_embeddings`), or None
        self.projected_embeddings: list[torch.Tensor] | None = None

    @torch.no_grad()
    def project_codec_embeddings(self) -> None:
        """Precompute small_to_mtp_projection(codec_embedding[g].weight) for the 1.7B model's 2048 -> 1024
        projection (the 0.6B model's is the identity: nothing to do), so that a few-row pass's input is one row
        lookup instead of a lookup and a GEMV (`pass_inputs`). The tables hold what the projection gives for each id
        (F.linear over all ids at once: within the model dtype's rounding of the per-step product). Tables for the
        14 codebooks that feed a pass (the 15th only feeds the talker): 59 MB in bf16 at 1.7B."""
        proj = self.small_to_mtp_projection
        if isinstance(proj, nn.Linear):
            assert proj.in_features != proj.out_features, "forward_step tells projected inputs by their width"
            self.projected_embeddings = [proj(table.weight) for table in self.model.codec_embedding[:-1]]

    def pass_inputs(self, code: torch.Tensor, group: int) -> torch.Tensor:
        """Input of the pass after `group`, from its code [B]: [B, 1, H_talker], or [B, 1, H_cp] already projected
        (a row of `projected_embeddings`) where that pass runs as GEMVs; `forward_step` tells them by width."""
        if self.projected_embeddings is not None and self.model.takes_gemv_path(code[:, None]):
            return F.embedding(code, self.projected_embeddings[group])[:, None]
        return self.model.codec_embedding[group](code)[:, None]

    def forward_step(
        self, inputs: torch.Tensor, positions: torch.Tensor | slice, ctx: AttentionContext, group: int
    ) -> torch.Tensor:
        """inputs [B, S, H_talker] (or [B, 1, H_cp] from `pass_inputs`) -> logits [B, vocab] of codebook `group + 1`
        (last row only).

        On the GEMV path (a few rows, stages/gemv_kernels.py) the input projection is a GEMV too, and the final
        norm, this head and the logits' cast to fp32 are one kernel; the logits are then fp32 (elsewhere in the
        model's dtype)."""
        proj = self.small_to_mtp_projection
        if self.model.takes_gemv_path(inputs):
            # the 1.7B model's 2048 -> 1024 (the 0.6B model's is the identity), unless `pass_inputs` projected already
            if isinstance(proj, nn.Linear) and inputs.shape[-1] == proj.in_features:
                b, s, width = inputs.shape
                x = gemv_kernels.gemv(inputs.reshape(b * s, width), proj.weight, bias=proj.bias,
                                      pdl=self.model.kernels.pdl).view(b, s, -1)
            else:
                x = inputs
            h = self.model(x, positions, ctx, final_norm=False)
            norm = self.model.norm
            return gemv_kernels.gemv(h[:, -1], self.lm_head[group].weight, norm=(norm.weight, norm.eps),
                                     out_dtype=torch.float32, pdl=self.model.kernels.pdl)
        h = self.model(proj(inputs), positions, ctx)
        return self.lm_head[group](h[:, -1])


class Talker(nn.Module):
    """`talker`: backbone + text projection + codec head + code predictor."""

    def __init__(self, cfg: TalkerConfig):
        super().__init__()
        self.config = cfg
        self.model = TalkerBackbone(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg)
        self.codec_tables: torch.Tensor | None = None  # the 16 codebooks' embeddings stacked (stack_codec_embeddings)
        self.codec_offsets: torch.Tensor | None = None  # [16]: each codebook's first row in codec_tables

    def stack_codec_embeddings(self) -> None:
        """The 16 codebook embeddings as one table, each module's weight a view of its rows (no weight twice, the
        state dict unchanged), so that `embed_frame_codes` is one gather instead of 16 lookups and a stack. Call
        it once the weights are loaded and placed (a later `.to()` would copy table and views apart)."""
        if self.codec_tables is not None:
            return
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        sizes = torch.tensor([t.weight.shape[0] for t in tables])
        self.codec_tables = stack_as_views(*tables)
        self.codec_offsets = (sizes.cumsum(0) - sizes).to(self.codec_tables.device)

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """P(ids): text tokens [...] -> [..., H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """C(ids): codebook-0 codes and control ids [...] -> [..., H]."""
        return self.model.codec_embedding(ids)

    def embed_frame_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of all 16 codebook embeddings of frames: codes [..., 16] -> [..., H].

        Stacked then summed over the codebook axis, in the same order as the official model, so the
        fp32 result is bit-identical; with `stack_codec_embeddings`, the stack is one gather from the joint table.
        """
        if self.codec_tables is not None:
            return F.embedding(codes + self.codec_offsets, self.codec_tables).sum(-2)
        tables = [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]
        parts = [table(codes[..., q]) for q, table in enumerate(tables)]
        return torch.stack(parts, dim=-2).sum(-2)

    def forward_hidden(self, embeds: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """embeds [B, S, H], positions [B, S] -> post-norm hidden states [B, S, H]."""
        return self.model(embeds, positions, ctx)

    def codec_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden)

    def codec_logits_fp32(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, H] -> `codec_logits(hidden).float()` [B, vocab]. On the GEMV path (a few rows) one GEMV whose
        fp32 output is rounded to the model's dtype first, so the same values as the eager head and cast, without
        the cuBLAS launch and the cast's kernel in the few-row step."""
        if self.model.takes_gemv_path(hidden[:, None]):
            return gemv_kernels.gemv(hidden, self.codec_head.weight, out_dtype=torch.float32, pdl=self.model.kernels.pdl)
        return self.codec_head(hidden).float()
