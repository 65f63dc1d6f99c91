"""The aligner's audio tower (the official `Qwen3ASRAudioEncoder`), batched across waveforms.

Per waveform the official tower cuts the mel frames into windows of `2 * n_window` frames (the last one shorter),
runs 3 stride-2 convolutions over each window, adds sinusoidal positions that restart in every window, and runs a
transformer whose attention stays inside blocks of `n_window_infer` mel frames' worth of tokens. The official code
does this one waveform at a time; here all windows of all waveforms share one convolution batch and all blocks one
attention batch, with the official padding semantics kept exactly (see `_conv_windows`).

The attention blocks are those of the official flash-attention and vLLM paths. The official eager/SDPA path (its
default) builds the same `cu_seqlens` but passes no mask, so there a waveform longer than one block (8 s in the
release) attends across blocks; within one block all paths agree.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stages.aligner.config import AudioEncoderConfig


def conv_output_frames(frames: int) -> int:
    """Tokens the tower makes of `frames` mel frames (the official `_get_feat_extract_output_lengths`, whose
    window of 100 frames is hard-coded: 13 tokens per full window)."""
    rest = frames % 100
    after_first = (rest - 1) // 2 + 1
    return ((after_first - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


def _stride2(length: int) -> int:
    return (length - 1) // 2 + 1


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels]: sin | cos of position / timescale (Whisper's; computed as the official code does)."""
    log_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


def encoder_layer(x: torch.Tensor, key_mask: torch.Tensor, weights: tuple[torch.Tensor, ...], heads: int,
                  eps: float) -> torch.Tensor:
    """One transformer layer of the tower as a function of its weights (`AudioEncoderLayer.weights`), so that one
    `torch.compile` of it serves every layer: x [N, L, d] (N blocks padded to L tokens), key_mask [N, 1, 1, L] bool
    -> [N, L, d]."""
    ln1_w, ln1_b, q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b, ln2_w, ln2_b, fc1_w, fc1_b, fc2_w, fc2_b = weights
    n, length, d = x.shape
    h = F.layer_norm(x, (d,), ln1_w, ln1_b, eps)
    q, k, v = (F.linear(h, w, b).view(n, length, heads, d // heads).transpose(1, 2)
               for w, b in ((q_w, q_b), (k_w, k_b), (v_w, v_b)))
    attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
    x = x + F.linear(attn.transpose(1, 2).reshape(n, length, d), o_w, o_b)
    x = x + F.linear(F.gelu(F.linear(F.layer_norm(x, (d,), ln2_w, ln2_b, eps), fc1_w, fc1_b)), fc2_w, fc2_b)
    if x.dtype == torch.float16:  # as the official layer: keep fp16 activations finite
        limit = torch.finfo(x.dtype).max - 1000
        x = x.clamp(-limit, limit)
    return x


class AudioAttention(nn.Module):
    """The attention weights of one tower layer (official names); the math is `encoder_layer`."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)


class AudioEncoderLayer(nn.Module):
    """One layer's weights under the official names; `encoder_layer` is its math."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.self_attn = AudioAttention(cfg.d_model, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model)

    def weights(self) -> tuple[torch.Tensor, ...]:
        a = self.self_attn
        return tuple(t for m in (self.self_attn_layer_norm, a.q_proj, a.k_proj, a.v_proj, a.out_proj,
                                 self.final_layer_norm, self.fc1, self.fc2) for t in (m.weight, m.bias))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor, layer_fn=encoder_layer) -> torch.Tensor:
        return layer_fn(x, key_mask, self.weights(), self.self_attn.heads, self.self_attn_layer_norm.eps)


class AudioEncoder(nn.Module):
    """Parameter names are the official ones (`thinker.audio_tower.*` in the checkpoint)."""

    def __init__(self, cfg: AudioEncoderConfig):
        super().__init__()
        self.config = cfg
        hidden = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1)
        freq = _stride2(_stride2(_stride2(cfg.num_mel_bins)))
        self.conv_out = nn.Linear(hidden * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self.register_buffer("positions", None, persistent=False)
        self.reset_buffers()
        self.layer_fn = encoder_layer  # `compile_layers` makes it one compiled function for all layers
        # (windows, frames) of the eager convolutions run so far: a new one is a new cuDNN problem (its plan, maybe
        # a runtime-compiled kernel), a one-time cost the Aligner server reports when a request meets it
        self.conv_shapes: set[tuple[int, int]] = set()

    def reset_buffers(self) -> None:
        """(Re)compute the sinusoid table; the loader calls this after materializing a meta-device model."""
        device = self.proj1.weight.device
        if device.type != "meta":
            self.positions = sinusoids(self.config.max_source_positions, self.config.d_model).to(device)

    def forward(self, features: torch.Tensor, frames: list[int], layers=None) -> list[torch.Tensor]:
        """features [B, mel, T] (row i valid up to frames[i]) -> per row its tokens [conv_output_frames(frames[i]),
        output_dim]. `layers`: runs the transformer layers (x [N, L, d], key_mask [N, 1, 1, L] -> [N, L, d]);
        `run_layers` by default."""
        tokens, counts = self._conv_windows(features, frames)
        block_rows = self._attention_blocks(tokens, counts)[1]
        sizes = [end - start for start, end in block_rows]
        longest = max(sizes)
        # each block's tokens at the start of its padded row: one scatter instead of a copy per block
        slots = torch.from_numpy(np.concatenate([np.arange(n) + i * longest for i, n in enumerate(sizes)]))
        x = tokens.new_zeros(len(sizes) * longest, tokens.shape[-1])
        x[slots.to(tokens.device)] = tokens
        x = x.view(len(sizes), longest, -1)
        lengths = torch.tensor(sizes, device=features.device)
        valid = torch.arange(longest, device=x.device)[None, :] < lengths[:, None]  # [N, L]
        key_mask = valid[:, None, None, :]
        x = (layers or self.run_layers)(x, key_mask)
        out = self.proj2(F.gelu(self.proj1(self.ln_post(x[valid]))))  # the valid tokens, in order
        return list(out.split(counts))

    def run_layers(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, key_mask, self.layer_fn)
        return x

    def compile_layers(self) -> None:
        """The layers' math as one `torch.compile`d function (dynamic shapes: any number and length of blocks):
        its norms, GELU and residual adds fused into a few kernels."""
        self.layer_fn = torch.compile(encoder_layer, dynamic=True, fullgraph=True)

    def _conv_windows(self, features: torch.Tensor, frames: list[int]) -> tuple[torch.Tensor, list[int]]:
        """All windows of all rows through the convolutions at once -> (tokens of all rows in order [sum, d_model],
        token count per row).

        The official tower pads a row's windows to that row's longest window: the short last window of a row of
        several windows is zero-padded to `2 * n_window` frames, and the padding (biased, through GELU) reaches its
        last tokens; a row of one window is not padded at all. Here all windows are padded to one length, and after
        each convolution the positions past a single-window row's valid length are zeroed, which is exactly the
        zero padding of its unpadded convolution."""
        chunk = self.config.chunk_frames
        rows, mel, width = features.shape
        per_row = -(-width // chunk)  # windows of the longest row
        picked, lengths, exact = [], [], []  # per window: its index among all rows' windows, its frames, alone?
        for row, n in enumerate(frames):
            starts = range(0, n, chunk)
            for w, start in enumerate(starts):
                picked.append(row * per_row + w)
                lengths.append(min(chunk, n - start))
                exact.append(len(starts) == 1)
        longest = max(lengths)
        # every row cut into windows at once; frames past a row's own are zeros, as a copy of its windows pads them
        ends = torch.tensor(frames, device=features.device)
        in_row = torch.arange(width, device=features.device)[None, :] < ends[:, None]
        x = F.pad(torch.where(in_row[:, None, :], features, 0), (0, per_row * chunk - width))
        x = x.view(rows, mel, per_row, chunk).permute(0, 2, 1, 3).reshape(rows * per_row, 1, mel, chunk)
        x = x[torch.tensor(picked, device=features.device), ..., :longest]
        self.conv_shapes.add((x.shape[0], x.shape[-1]))
        length = torch.tensor(lengths, device=features.device)
        unpadded = torch.tensor(exact, device=features.device)
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
            length = (length - 1) // 2 + 1
            keep = (torch.arange(x.shape[-1], device=x.device)[None, :] < length[:, None]) | ~unpadded[:, None]
            x = x * keep[:, None, None, :].to(x.dtype)
        n, c, f, t = x.shape
        # contiguous: as a view the product's rows would be 13 apart, which takes cuBLAS's slow unaligned kernels
        x = self.conv_out(x.permute(0, 3, 1, 2).contiguous().view(n, t, c * f)) + self.positions[:t].to(x.dtype)
        valid = torch.arange(t, device=x.device)[None, :] < length[:, None]
        counts = [conv_output_frames(n) for n in frames]
        return x[valid], counts

    def _attention_blocks(self, tokens: torch.Tensor, counts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Blocks of the official block attention as (row per block, [start, end) of each block in `tokens`).

        A row's block is `n_window_infer // (2 * n_window)` times its longest window's token count (13 for any row
        of a full window: the official quirk that a row shorter than one window is one block)."""
        chunk = self.config.chunk_frames
        per_window = conv_output_frames(chunk)
        factor = self.config.n_window_infer // chunk
        rows, spans, offset = [], [], 0
        for row, count in enumerate(counts):
            block = (per_window if count >= per_window else count) * factor
            for start in range(0, count, block):
                rows.append(row)
                spans.append((offset + start, offset + min(start + block, count)))
            offset += count
        return rows, spans
