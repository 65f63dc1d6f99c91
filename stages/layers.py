"""Building blocks of the Qwen3-style decoder used by the talker and the code predictor.

Parameter names follow the official checkpoint (`self_attn.q_proj`, `mlp.gate_proj`, ...) so the
state dicts load unchanged. The KV cache is not owned here: attention asks an `AttentionContext`
(stages/talker/contiguous_kv.py) to store this step's keys/values and hand back what to attend over, which lets
the eager reference path and the batched engine share every module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from stages import gemv_kernels
from stages.config import TransformerConfig
from stages.dynamic_compile import compile_dynamic
from stages.talker.paged_attention import HeadNorm


class AttentionContext(Protocol):
    """Where keys/values of the current forward go, and what the queries may attend to."""

    is_causal: bool  # queries attend causally among themselves (prefill from an empty cache)
    mask: torch.Tensor | None  # [B, 1, S, L] bool, True = may attend; used when not is_causal

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, n_kv, S, D] for `layer_idx`; return the keys/values to attend over."""
        ...


class SelfAttendingContext(Protocol):
    """A context that stores k/v and computes attention itself (the engine's paged KV: its keys are not one
    contiguous tensor, and a kernel reads them in place)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               head_norm: HeadNorm | None = None) -> torch.Tensor:
        """q [B, h, 1, D], new k/v [B, n_kv, 1, D] -> [B, 1, h*D] (`head_norm`: q/k before head norm and RoPE)."""
        ...

    def folds_heads(self, s: int) -> bool:
        """Whether `attend` takes `head_norm` for a forward of `s` new positions per row."""
        ...


class RMSNorm(nn.Module):
    """RMSNorm that normalizes in fp32 and casts back before scaling (as the official model)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2], fp32: theta ** -(2i / head_dim) (as the original)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    return 1.0 / (theta ** (exponent / head_dim))


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., head_dim] in `dtype`, computed in fp32 (rotate-half layout).

    The one RoPE table of the project: the talker's `Rotary` and the code2wav transformer both use it.
    """
    freqs = positions.float()[..., None] * inv_freq.float()  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Rotary(nn.Module):
    """Plain 1-D RoPE. The talker's "interleaved M-RoPE" uses 3 equal position rows, which is exactly this."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.register_buffer("table", None, persistent=False)  # [2, P, D] cos/sin rows, set by build_table
        self.reset_buffers()

    def build_table(self, max_positions: int, dtype: torch.dtype) -> None:
        """cos/sin of positions 0..max_positions-1, so that `forward` is one lookup instead of ~7 small kernels.
        Bit-identical to computing them (the same elementwise fp32 math per position); the caller guarantees
        that positions stay below `max_positions` (a lookup cannot check without a host sync)."""
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        self.table = torch.stack(rope_cos_sin(positions, self.inv_freq, dtype))

    def reset_buffers(self) -> None:
        """(Re)compute inv_freq; the loader calls this after materializing a meta-device model."""
        self.inv_freq.copy_(rope_inv_freq(self.head_dim, self.theta, self.inv_freq.device))

    @torch.no_grad()
    def forward(self, positions: torch.Tensor | slice, dtype: torch.dtype, batch: int = 1
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, S] -> cos, sin [B, 1, S, D] in `dtype` (computed in fp32 like the original). A slice is
        the same positions for all `batch` rows (the code predictor's passes): with the table, its rows expanded
        over the batch, a view that costs no kernel."""
        if isinstance(positions, slice):
            if self.table is not None and self.table.dtype == dtype:
                rows = self.table[:, positions]  # [2, S, D]
                cos_sin = rows[:, None, None].expand(2, batch, 1, *rows.shape[1:])
                return cos_sin[0], cos_sin[1]
            positions = torch.arange(positions.start, positions.stop, device=self.inv_freq.device).expand(batch, -1)
        if self.table is not None and self.table.dtype == dtype:
            cos_sin = self.table[:, positions]  # [2, B, S, D]
            return cos_sin[0][:, None], cos_sin[1][:, None]
        cos, sin = rope_cos_sin(positions, self.inv_freq, dtype)
        return cos[:, None], sin[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _project(h: torch.Tensor, weights: tuple[torch.Tensor, ...], sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """The products of `h` with each weight: one product per weight, or (one weight: the row-stacked weights of
    `fuse_projections`) one product split into `sizes`. Fewer, larger GEMMs: at batch 1 each is bound by its launch."""
    if len(weights) == 1:
        return F.linear(h, weights[0]).split(sizes, dim=-1)
    return tuple(F.linear(h, w) for w in weights)


def attention_inputs(
    x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: tuple[torch.Tensor, ...],
    q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input RMSNorm -> q/k/v projections -> per-head q/k RMSNorm -> RoPE. x [B, S, H] -> q, k, v [B, h, S, D].

    `qkv_w`: (q, k, v) weights, or the one stacked weight of a fused layer."""
    q, k, v = norm_project(x, norm_w, eps, qkv_w, (num_heads * head_dim, num_kv_heads * head_dim,
                                                    num_kv_heads * head_dim))
    return heads_norm_rope(q, k, v, q_norm_w, k_norm_w, eps, cos, sin, num_heads, num_kv_heads, head_dim)


def norm_project(x: torch.Tensor, norm_w: torch.Tensor, eps: float, qkv_w: tuple[torch.Tensor, ...],
                 sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """input RMSNorm -> q/k/v projections [B, S, h*D] (before the per-head norm and RoPE)."""
    return _project(_rms(x, norm_w, eps), qkv_w, sizes)


def heads_norm_rope(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_w: torch.Tensor, k_norm_w: torch.Tensor, eps: float,
    cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projected q/k/v [B, S, h*D] -> per-head q/k RMSNorm -> RoPE -> q, k, v [B, h, S, D]."""
    b, s, _ = q.shape
    q = _rms(q.view(b, s, num_heads, head_dim), q_norm_w, eps).transpose(1, 2)
    k = _rms(k.view(b, s, num_kv_heads, head_dim), k_norm_w, eps).transpose(1, 2)
    v = v.view(b, s, num_kv_heads, head_dim).transpose(1, 2)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def attention_output_and_mlp(
    x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, norm_w: torch.Tensor, eps: float,
    gate_up_w: tuple[torch.Tensor, ...], down_w: torch.Tensor,
) -> torch.Tensor:
    """o_proj + residual, post-attention RMSNorm, SwiGLU MLP + residual. attn [B, S, h*D] -> [B, S, H].

    `gate_up_w`: (gate, up) weights, or the one stacked weight of a fused layer."""
    x = x + F.linear(attn, o_w)
    h = _rms(x, norm_w, eps)
    inner = down_w.shape[1]
    gate, up = _project(h, gate_up_w, (inner, inner))
    return x + F.linear(F.silu(gate) * up, down_w)


def stack_as_views(*linears: nn.Linear | nn.Embedding) -> torch.Tensor:
    """One tensor holding the modules' weights row after row; each `weight` becomes a view of its rows, so the
    state dict keeps the checkpoint's names and no weight is held twice."""
    stacked = torch.cat([lin.weight.detach() for lin in linears])
    at = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(stacked[at:at + rows], requires_grad=lin.weight.requires_grad)
        at += rows
    return stacked


class Attention(nn.Module):
    """GQA attention with per-head RMSNorm on q and k before RoPE (Qwen3)."""

    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               ctx: AttentionContext | SelfAttendingContext, head_norm: HeadNorm | None = None) -> torch.Tensor:
        """q [B, h, S, D], new k/v [B, n_kv, S, D] -> attention output [B, S, h*D] (cache updated by ctx).

        `head_norm`: q and k are projections before the head norm and RoPE, which the context's kernel applies
        (only where `ctx.folds_heads(S)`)."""
        if hasattr(ctx, "attend"):
            return ctx.attend(self.layer_idx, q, k, v, head_norm)
        b, _, s, _ = q.shape
        if getattr(ctx, "decode_kernel", False) and s <= ctx.KERNEL_MAX_ROWS:
            # a cache with its own decode kernel (ContiguousKV on CUDA), a few new rows: the kernel stores them too
            return ctx.decode_attention(self.layer_idx, q, k, v, head_norm).reshape(b, s, self.num_heads * self.head_dim)
        assert head_norm is None, "this context cannot apply the head norm and RoPE"
        k, v = ctx.update(self.layer_idx, k, v)  # [B, n_kv, L, D]
        if s == 1 and not ctx.is_causal:
            # decode: the query heads sharing a KV head become rows of one [group, D] query block, so
            # GQA needs no expanded K/V copy and the mask backend of SDPA stays usable
            group = self.num_heads // self.num_kv_heads
            qg = q.reshape(b, self.num_kv_heads, group, self.head_dim)
            out = F.scaled_dot_product_attention(qg, k, v, attn_mask=ctx.mask)  # [B, n_kv, group, D]
            return out.reshape(b, 1, self.num_heads * self.head_dim)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=None if ctx.is_causal else ctx.mask,
            is_causal=ctx.is_causal and s > 1,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, H, S, D]
        return out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)


class MLP(nn.Module):
    """SwiGLU weights (`gate_proj`, `up_proj`, `down_proj`); the math is `attention_output_and_mlp`."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # set by fuse_projections; non-persistent buffers: not in the state dict, moved by `.to()`
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("gate_up_weight", None, persistent=False)

    def fuse_projections(self) -> None:
        """q/k/v and gate/up each become one product (two GEMMs per layer instead of five) on the compiled path
        (`kernels` given); the eager path keeps the separate products. Call it once the weights are loaded and
        placed: the stacked tensors are non-persistent buffers (the state dict is unchanged), and a later `.to()`
        would copy stack and views apart (equal values, twice the memory)."""
        if self.qkv_weight is not None:
            return
        a, m = self.self_attn, self.mlp
        self.qkv_weight = stack_as_views(a.q_proj, a.k_proj, a.v_proj)
        self.gate_up_weight = stack_as_views(m.gate_proj, m.up_proj)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttentionContext | SelfAttendingContext, kernels: LayerKernels | None = None) -> torch.Tensor:
        a, m = self.self_attn, self.mlp
        if kernels is not None and self.qkv_weight is not None:
            return self._forward_fused(x, cos, sin, ctx, kernels)
        # the eager reference (and compiled kernels over separate projections)
        pre, post = (kernels.pre, kernels.post) if kernels is not None else (attention_inputs, attention_output_and_mlp)
        q, k, v = pre(x, self.input_layernorm.weight, self.input_layernorm.eps,
                      (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), a.q_norm.weight, a.k_norm.weight, cos, sin,
                      a.num_heads, a.num_kv_heads, a.head_dim)
        attn = a.attend(q, k, v, ctx)
        return post(x, attn, a.o_proj.weight, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps,
                    (m.gate_proj.weight, m.up_proj.weight), m.down_proj.weight)

    def _forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       ctx: AttentionContext | SelfAttendingContext, kernels: LayerKernels) -> torch.Tensor:
        """The engine's path: q/k/v and gate/up as one product each, and per forward
        - a few rows (<= `gemv_rows`): the four products as Triton GEMVs with the input norms, SwiGLU and residuals
          fused into them (stages/gemv_kernels.py); otherwise the compiled `pre`/`post` around cuBLAS;
        - a context whose attention kernel applies the q/k head norm and RoPE itself (`heads_in_attention`, decode
          on CUDA): q/k go to it as projected, so they cost no kernels of their own."""
        a, m = self.self_attn, self.mlp
        ln, post_ln = self.input_layernorm, self.post_attention_layernorm
        b, s, hidden = x.shape
        few_rows = kernels.takes_gemv_path(x)
        fold = kernels.heads_in_attention and hasattr(ctx, "folds_heads") and ctx.folds_heads(s)
        sizes = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim)
        rows = x.reshape(b * s, hidden)
        pdl = kernels.pdl
        if few_rows:
            q, k, v = gemv_kernels.gemv(rows, self.qkv_weight, norm=(ln.weight, ln.eps), pdl=pdl).view(b, s, -1).split(
                sizes, -1)
        elif fold:
            q, k, v = kernels.project(x, ln.weight, ln.eps, (self.qkv_weight,), sizes)
        else:
            q, k, v = kernels.pre(x, ln.weight, ln.eps, (self.qkv_weight,), a.q_norm.weight, a.k_norm.weight, cos, sin,
                                  a.num_heads, a.num_kv_heads, a.head_dim)
        if fold:
            q, k, v = (t.view(b, s, n, a.head_dim).transpose(1, 2)
                       for t, n in ((q, a.num_heads), (k, a.num_kv_heads), (v, a.num_kv_heads)))
            attn = a.attend(q, k, v, ctx, HeadNorm(a.q_norm.weight, a.k_norm.weight, ln.eps, cos, sin))
        else:
            if few_rows:
                q, k, v = kernels.heads(q, k, v, a.q_norm.weight, a.k_norm.weight, ln.eps, cos, sin, a.num_heads,
                                        a.num_kv_heads, a.head_dim)
            attn = a.attend(q, k, v, ctx)
        if not few_rows:
            return kernels.post(x, attn, a.o_proj.weight, post_ln.weight, post_ln.eps, (self.gate_up_weight,),
                                m.down_proj.weight)
        h = gemv_kernels.gemv(attn.reshape(b * s, -1), a.o_proj.weight, residual=rows, pdl=pdl)
        act = gemv_kernels.gemv(h, self.gate_up_weight, norm=(post_ln.weight, post_ln.eps), swiglu=True, pdl=pdl)
        return gemv_kernels.gemv(act, m.down_proj.weight, residual=h, pdl=pdl).view(b, s, hidden)


@dataclass(frozen=True)
class LayerKernels:
    """The per-layer functions and the final norm, possibly `torch.compile`d (fused kernels for the CUDA-graph
    engine)."""

    pre: Callable
    post: Callable
    norm: Callable = _rms  # the stack's final RMSNorm (eager: ~7 kernels; compiled: one)
    heads: Callable = heads_norm_rope  # q/k norm + RoPE on projected rows (the GEMV path's `pre` after its product)
    project: Callable = norm_project  # input norm + q/k/v product alone (`pre` when attention applies the heads')
    gemv_rows: int = 0  # forwards of at most this many rows (batch x positions) take the GEMV path; 0: never
    pdl: bool = False  # the GEMVs launch with programmatic dependent launch (sm_90+; stages/pdl.py)
    heads_in_attention: bool = False  # q/k head norm + RoPE inside the attention kernel where the context can

    def takes_gemv_path(self, x: torch.Tensor) -> bool:
        """Whether a forward of x [B, S, H] (over fused projections) runs as GEMVs: B x S <= `gemv_rows`."""
        return x.shape[0] * x.shape[1] <= self.gemv_rows

    @classmethod
    def compiled(cls, gemv_rows: int = 0, heads_in_attention: bool = False, pdl: bool = False) -> LayerKernels:
        """`gemv_rows` > 0 needs CUDA and Triton (`stages/gemv_kernels.available`), `heads_in_attention` the
        Triton decode attention (`stages/talker/paged_attention.kernel_available`); both act on fused
        projections only."""
        if gemv_rows > gemv_kernels.MAX_ROWS:
            raise ValueError(f"gemv_rows {gemv_rows} > {gemv_kernels.MAX_ROWS}")
        return cls(pre=compile_dynamic(attention_inputs), post=compile_dynamic(attention_output_and_mlp),
                   norm=compile_dynamic(_rms), heads=compile_dynamic(heads_norm_rope),
                   project=compile_dynamic(norm_project),
                   gemv_rows=gemv_rows, heads_in_attention=heads_in_attention, pdl=pdl)


class DecoderStack(nn.Module):
    """`layers.*` + final `norm`: embeddings in, post-norm hidden states out."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.kernels: LayerKernels | None = None  # None: eager; set by an engine that compiles

    def forward(self, x: torch.Tensor, positions: torch.Tensor | slice, ctx: AttentionContext,
                final_norm: bool = True) -> torch.Tensor:
        """x [B, S, H], positions [B, S] (or a slice: the same for every row) -> [B, S, H] after the final norm
        (before it: `final_norm=False`, for a caller that fuses it into its head's product)."""
        cos, sin = self.rotary(positions, x.dtype, x.shape[0])
        for layer in self.layers:
            x = layer(x, cos, sin, ctx, self.kernels)
        if not final_norm:
            return x
        if self.kernels is not None:
            return self.kernels.norm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    def use_kernels(self, kernels: LayerKernels, max_positions: int) -> None:
        """The engine's fast path: `kernels` for the layer math and final norm, q/k/v and gate/up fused into one
        product each, and RoPE from a table of positions < `max_positions`. Call it once the weights are loaded
        and placed on their device."""
        self.fuse_projections()
        self.rotary.build_table(max_positions, self.norm.weight.dtype)
        self.kernels = kernels

    def takes_gemv_path(self, x: torch.Tensor) -> bool:
        """Whether a forward of x [B, S, H] runs its layers as Triton GEMVs (`LayerKernels.gemv_rows`)."""
        return self.kernels is not None and self.layers[0].qkv_weight is not None and self.kernels.takes_gemv_path(x)

    def fuse_projections(self) -> None:
        """Every layer's q/k/v and gate/up as one product each (`DecoderLayer.fuse_projections`)."""
        for layer in self.layers:
            layer.fuse_projections()
