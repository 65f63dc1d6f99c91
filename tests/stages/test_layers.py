"""The decoder stack's fused projections: q/k/v and gate/up as one product each on the compiled path."""

from __future__ import annotations

import torch

from stages.config import TransformerConfig
from stages.layers import DecoderStack, LayerKernels, attention_inputs, attention_output_and_mlp
from stages.talker.contiguous_kv import ContiguousKV

CFG = TransformerConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32)

# the uncompiled functions as "kernels": the path the compiled engine takes, minus torch.compile (CPU CI)
PLAIN_KERNELS = LayerKernels(pre=attention_inputs, post=attention_output_and_mlp)


def _stack(seed: int = 0) -> DecoderStack:
    torch.manual_seed(seed)
    stack = DecoderStack(CFG)
    with torch.no_grad():
        for p in stack.parameters():
            p.normal_(0.0, 0.2)
    return stack.eval()


def _forward(stack: DecoderStack, x: torch.Tensor, kernels: LayerKernels | None) -> torch.Tensor:
    """A prompt forward, then two one-row decode steps over the same cache: [B, S + 2, H]."""
    b, s, _ = x.shape
    stack.kernels = kernels
    kv = ContiguousKV(CFG.num_hidden_layers, b, CFG.num_key_value_heads, CFG.head_dim, s + 2, x.dtype, "cpu")
    outs = []
    with torch.no_grad():
        for start, end in ((0, s - 2), (s - 2, s - 1), (s - 1, s)):
            kv.begin(end - start)
            positions = torch.arange(start, end).expand(b, end - start)
            outs.append(stack(x[:, start:end], positions, kv))
            kv.advance()
    return torch.cat(outs, dim=1)


def test_fused_weights_are_views_and_the_state_dict_is_unchanged():
    stack = _stack()
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    n_params = sum(p.numel() for p in stack.parameters())
    stack.fuse_projections()
    after = stack.state_dict()
    assert list(after) == list(before)  # same names, same order: checkpoints load and save as before
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sum(p.numel() for p in stack.parameters()) == n_params
    layer = stack.layers[0]
    a, m = layer.self_attn, layer.mlp
    assert layer.qkv_weight.shape == (CFG.num_attention_heads * CFG.head_dim + 2 * CFG.num_key_value_heads
                                      * CFG.head_dim, CFG.hidden_size)
    # the separate weights are rows of the stacked tensor, not copies: loading into them updates the fused product
    for lin in (a.q_proj, a.k_proj, a.v_proj):
        assert lin.weight.untyped_storage().data_ptr() == layer.qkv_weight.untyped_storage().data_ptr()
    for lin in (m.gate_proj, m.up_proj):
        assert lin.weight.untyped_storage().data_ptr() == layer.gate_up_weight.untyped_storage().data_ptr()
    with torch.no_grad():
        a.k_proj.weight.fill_(0.5)
    rows = slice(CFG.num_attention_heads * CFG.head_dim, (CFG.num_attention_heads + CFG.num_key_value_heads)
                 * CFG.head_dim)
    assert torch.all(layer.qkv_weight[rows] == 0.5)
    stack.fuse_projections()  # idempotent
    assert layer.qkv_weight[rows].data_ptr() == a.k_proj.weight.data_ptr()


def test_fused_products_match_the_separate_ones():
    x = torch.randn(3, 7, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    stack = _stack()
    eager = _forward(stack, x, None)
    separate = _forward(stack, x, PLAIN_KERNELS)
    assert torch.equal(separate, eager)  # same functions, separate products: the same arithmetic
    stack.fuse_projections()
    fused = _forward(stack, x, PLAIN_KERNELS)
    err = (fused - eager).abs().max().item()
    assert err <= 1e-5 * eager.abs().max().item(), err  # fp32: one GEMM of stacked rows, same dot products
    # without kernels the fused layer still runs the separate products (the eager reference is unchanged)
    assert torch.equal(_forward(stack, x, None), eager)


def test_rope_table_lookup_is_bit_identical_to_computing_it():
    from stages.layers import Rotary

    rotary = Rotary(CFG.head_dim, CFG.rope_theta)
    positions = torch.tensor([[0, 1, 2], [7, 1023, 500]])
    for dtype in (torch.float32, torch.bfloat16):
        computed = rotary(positions, dtype)
        rotary.build_table(1024, dtype)
        looked_up = rotary(positions, dtype)
        assert all(torch.equal(a, b) for a, b in zip(computed, looked_up, strict=True))
        assert looked_up[0].shape == (2, 1, 3, CFG.head_dim)
        rotary.table = None
    rotary.build_table(1024, torch.bfloat16)  # a table of another dtype is not used
    fresh = Rotary(CFG.head_dim, CFG.rope_theta)(positions, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(rotary(positions, torch.float32), fresh, strict=True))


def test_rope_of_a_slice_is_the_same_positions_for_every_row_and_a_view_with_the_table():
    """The code predictor's passes give positions as a slice (the same for every row): the values of the tensor
    form, and with the table a view of its rows (a graphed pass then runs no index kernel for RoPE)."""
    from stages.layers import Rotary

    rotary = Rotary(CFG.head_dim, CFG.rope_theta)
    as_tensor = torch.arange(3, 5).expand(4, 2)
    for table in (False, True):
        if table:
            rotary.build_table(16, torch.float32)
        want = rotary(as_tensor, torch.float32)
        got = rotary(slice(3, 5), torch.float32, batch=4)
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert got[0].shape == (4, 1, 2, CFG.head_dim)
        if table:
            assert got[0].stride(0) == 0 and got[0].untyped_storage().data_ptr() == rotary.table.untyped_storage().data_ptr()


def test_use_kernels_sets_the_engine_path_up():
    x = torch.randn(2, 6, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    stack = _stack()
    eager = _forward(stack, x, None)
    stack.use_kernels(PLAIN_KERNELS, max_positions=8)
    assert stack.kernels is PLAIN_KERNELS and stack.layers[-1].qkv_weight is not None
    assert stack.rotary.table.shape == (2, 8, CFG.head_dim)
    engine_path = _forward(stack, x, PLAIN_KERNELS)
    assert (engine_path - eager).abs().max().item() <= 1e-5 * eager.abs().max().item()
