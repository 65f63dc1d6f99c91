"""Runs under Triton's interpreter (tests/triton_interpreter.py): the decode attention kernel applying q/k's head
norm and RoPE itself (`HeadNorm`, stages/talker/paged_attention.py) against the eager head math then the kernel
without it, and decoder stacks on the paged and the contiguous caches with `heads_in_attention` (and the GEMVs)
against their eager layers. fp32. Prints the max errors as JSON."""

from __future__ import annotations

import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch

from stages.config import TransformerConfig
from stages.layers import LayerKernels, Rotary, attention_inputs, attention_output_and_mlp, heads_norm_rope
from stages.talker import contiguous_kv
from stages.talker.paged_attention import (
    DecodeTiling,
    HeadNorm,
    contiguous_decode_attention,
    paged_decode_attention,
)
from stages.talker.paged_kv import DecodeContext, PagedKVCache, PrefillContext
from tests.kernel_reference import forwards, random_stack

H, N_KV, D, EPS = 4, 2, 16, 1e-6


def kernel_alone() -> dict:
    """One call per cache kind: projected q/k + HeadNorm against heads_norm_rope then the plain kernel; the output
    and the key it stores."""
    gen = torch.Generator().manual_seed(0)
    b, page, keys = 3, 4, 9
    rotary = Rotary(D, 10000.0)
    positions = torch.tensor([[keys - 1], [keys - 3], [2]])
    cos, sin = rotary(positions, torch.float32)
    qn_w, kn_w = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    qkv = torch.randn(b, 1, (H + 2 * N_KV) * D, generator=gen)
    q, k, v = qkv.split((H * D, N_KV * D, N_KV * D), -1)
    q_rot, k_rot, v_ref = heads_norm_rope(q, k, v, qn_w, kn_w, EPS, cos, sin, H, N_KV, D)
    q_raw, k_raw, v_raw = (t.view(b, 1, n, D).transpose(1, 2) for t, n in ((q, H), (k, N_KV), (v, N_KV)))
    blocks = b * 3 + 1
    pool = torch.randn(blocks * page, N_KV, D, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:b * 3].view(b, 3)
    lens = positions[:, 0] + 1
    out, stored = {}, {}
    for name in ("reference", "fused", "split2", "split4"):
        k_pool, v_pool = pool.clone(), pool.clone()
        if name == "reference":
            o = paged_decode_attention(q_rot[:, :, 0], k_pool, v_pool, table, lens, page,
                                       new_kv=(k_rot[:, :, 0], v_ref[:, :, 0]))
        else:  # keys_per_iteration 4: several tiles per row; split4 over 9 / 7 / 3 keys: tiles 0-3, 4-7, 8 (the
            # new key in the third split), 0-3, 4-6 and two empty splits, 0-2 and three empty ones
            o = paged_decode_attention(q_raw[:, :, 0], k_pool, v_pool, table, lens, page, tiling=DecodeTiling(4, 4),
                                       new_kv=(k_raw[:, :, 0], v_raw[:, :, 0]),
                                       head_norm=HeadNorm(qn_w, kn_w, EPS, cos, sin),
                                       splits=int(name[5:]) if name.startswith("split") else 1)
        out[name], stored[name] = o, k_pool
    result = {"paged_out": (out["fused"] - out["reference"]).abs().max().item(),
              "paged_stored_k": (stored["fused"] - stored["reference"]).abs().max().item()}
    for name in ("split2", "split4"):  # the key/value the split kernel stored, and its merged output
        result[f"paged_{name}_out"] = (out[name] - out["reference"]).abs().max().item()
        result[f"paged_{name}_stored_k"] = (stored[name] - stored["reference"]).abs().max().item()
    # reading only (no new key), 8 splits of one 4-key tile at most: every row has empty splits
    k_pool = stored["reference"]
    plain = paged_decode_attention(q_rot[:, :, 0], k_pool, k_pool, table, lens, page, tiling=DecodeTiling(4, 4))
    split = paged_decode_attention(q_rot[:, :, 0], k_pool, k_pool, table, lens, page, tiling=DecodeTiling(4, 4), splits=8)
    result["paged_split8_read_only"] = (split - plain).abs().max().item()
    # contiguous cache: 2 new positions (the code predictor's first pass), one call each
    cos2, sin2 = rotary(torch.arange(2).expand(b, 2), torch.float32)
    qkv2 = torch.randn(b, 2, (H + 2 * N_KV) * D, generator=gen)
    q, k, v = qkv2.split((H * D, N_KV * D, N_KV * D), -1)
    q_rot, k_rot, v_ref = heads_norm_rope(q, k, v, qn_w, kn_w, EPS, cos2, sin2, H, N_KV, D)
    q_raw, k_raw, v_raw = (t.view(b, 2, n, D).transpose(1, 2) for t, n in ((q, H), (k, N_KV), (v, N_KV)))
    rows, lengths = torch.arange(b)[:, None], torch.arange(17)
    worst = 0.0
    caches = [(torch.zeros(b, N_KV, 16, D), torch.zeros(b, N_KV, 16, D)) for _ in range(2)]
    for i in range(2):
        ref = contiguous_decode_attention(q_rot[:, :, i], *caches[0], rows, lengths[i + 1:i + 2],
                                          new_kv=(k_rot[:, :, i], v_ref[:, :, i]))
        got = contiguous_decode_attention(q_raw[:, :, i], *caches[1], rows, lengths[i + 1:i + 2],
                                          new_kv=(k_raw[:, :, i], v_raw[:, :, i]),
                                          head_norm=HeadNorm(qn_w, kn_w, EPS, cos2, sin2).at(i))
        worst = max(worst, (got - ref).abs().max().item(), (caches[1][0] - caches[0][0]).abs().max().item())
    result["contiguous"] = worst
    return result


CFG = TransformerConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H,
                        num_key_value_heads=N_KV, head_dim=D)


def stacks() -> dict:
    """The contiguous cache (code predictor: 2-position first pass, then 1) and the paged cache (talker: prefill,
    then decode steps; with and without split keys), with heads_in_attention, with and without the GEMVs, against
    eager layers; and how many
    kernel calls applied a HeadNorm (the path was taken, not the compiled heads before the kernel)."""
    contiguous_kv.kernel_available = lambda _device: True  # the decode kernel on CPU tensors (interpreted)
    calls = []
    head_norm_args = HeadNorm.args
    HeadNorm.args = lambda self: calls.append(1) or head_norm_args(self)
    stack = random_stack(CFG)
    result = {}
    for gemv_rows in (0, 8):
        kernels = LayerKernels(pre=attention_inputs, post=attention_output_and_mlp, gemv_rows=gemv_rows,
                               heads_in_attention=True)
        b, widths = 2, (2, 1, 1)
        x = torch.randn(b, sum(widths), CFG.hidden_size)
        outs = {}
        calls.clear()
        for name, k in (("eager", None), ("fused", kernels)):
            stack.kernels = k
            outs[name] = forwards(stack, x, widths, contiguous_kv.ContiguousKV(
                CFG.num_hidden_layers, b, N_KV, D, 16, torch.float32, "cpu", decode_kernel=name == "fused"))
        result[f"contiguous_gemv{gemv_rows}"] = (outs["fused"] - outs["eager"]).abs().max().item()
        result[f"contiguous_gemv{gemv_rows}_head_norm_calls"] = len(calls)
        calls.clear()
        # paged: 2 rows with prompts of 5 and 3 positions (prefill, eager), then 3 decode steps
        prompt_lens, steps, page = (5, 3), 3, 4
        x = torch.randn(2, max(prompt_lens) + steps, CFG.hidden_size)
        outs = {}
        for name, k in (("eager", None), ("fused", kernels), ("split", kernels)):
            if name == "split":  # the same with each row's keys split over decode_splits(2, N_KV) = 16 programs
                result[f"paged_gemv{gemv_rows}_head_norm_calls"] = len(calls)
            stack.kernels = None
            cache = PagedKVCache(CFG.num_hidden_layers, 8, page, N_KV, D, 2, 16, torch.float32, torch.device("cpu"))
            cache.block_table[0, :4] = torch.tensor([3, 0, 6, 1])
            cache.block_table[1, :4] = torch.tensor([2, 5, 4, 7])
            width = max(prompt_lens)
            pos = torch.arange(width).expand(2, width)
            write = cache.token_index(torch.arange(2), torch.where(pos < torch.tensor(prompt_lens)[:, None], pos,
                                                                   torch.full_like(pos, 15)))
            with torch.no_grad():
                stack(x[:, :width], pos, PrefillContext(cache, write))
                stack.kernels = k
                positions = torch.tensor(prompt_lens)
                parts = []
                for t in range(steps):
                    ctx = DecodeContext(cache, positions, 16, kernel=name != "eager", split_keys=name == "split")
                    assert ctx.splits == (16 if name == "split" else 1)
                    parts.append(stack(x[:, width + t:width + t + 1], positions[:, None], ctx))
                    positions = positions + 1
            outs[name] = torch.cat(parts, dim=1)
        result[f"paged_gemv{gemv_rows}"] = (outs["fused"] - outs["eager"]).abs().max().item()
        result[f"paged_split_gemv{gemv_rows}"] = (outs["split"] - outs["eager"]).abs().max().item()
    return result


if __name__ == "__main__":
    print(json.dumps({"kernel": kernel_alone(), "stacks": stacks()}))
