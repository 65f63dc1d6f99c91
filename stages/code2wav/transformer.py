"""The code2wav pre-transformer: causal sliding-window attention over latent frames (RoPE, RMSNorm, SwiGLU).

Positions restart at 0 on every forward call (the official decoder keeps no cache), so a chunk's
output depends on which frames the call was given, not on any absolute time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stages.code2wav.config import DecoderConfig
from stages.layers import RMSNorm, apply_rotary, rope_cos_sin, rope_inv_freq  # the talker's math (fp32 norm, RoPE)

ACT_FNS = {"silu": F.silu, "gelu": F.gelu}


def sliding_window_causal_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool [T, T], True = may attend: key k is visible to query q iff q - window < k <= q."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return (k <= q) & (k > q - window)


class LayerScale(nn.Module):
    """Learned per-channel scale on a residual branch (init 0.01)."""

    def __init__(self, dim: int, init: float):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class Attention(nn.Module):
    """Multi-head attention with RoPE; the sliding-window mask is built once per forward by the caller."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:  # x [B, T, hidden], mask [T, T] bool
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.num_kv_heads != self.num_heads:  # GQA: query head h reads kv head h // group
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT_FNS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, hidden]
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    """Pre-norm block: x + s1 * attn(norm(x)); then x + s2 * mlp(norm(x))."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SwiGLU(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    """latent_dim -> hidden_size -> N layers -> RMSNorm -> latent_dim, over frames [B, T, latent_dim]."""

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.input_proj = nn.Linear(cfg.latent_dim, cfg.hidden_size)
        self.layers = nn.ModuleList(TransformerLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output_proj = nn.Linear(cfg.hidden_size, cfg.latent_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, latent_dim] -> [B, T, latent_dim]
        T = x.shape[1]
        h = self.input_proj(x)
        # cos/sin tables [T, head_dim] for positions 0..T-1, computed in fp32 then cast (as the official code)
        inv_freq = rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, h.device)
        cos, sin = rope_cos_sin(torch.arange(T, device=h.device), inv_freq, h.dtype)
        mask = sliding_window_causal_mask(T, self.cfg.sliding_window, h.device)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        return self.output_proj(self.norm(h))
