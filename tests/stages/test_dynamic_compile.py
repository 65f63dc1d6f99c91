"""stages/dynamic_compile.py: the engines' compiled functions are traced once for the shapes a variant covers, whatever
views or sizes the caller happens to pass, and in-place writes through a view still land in the caller's tensor.

The trace counts use Dynamo with AOT Autograd's eager backend (the guards are Dynamo's and AOT's: what decides a
trace); the in-place test compiles through CPU Inductor, as the engines do on CUDA. The functions are the talker's
own; the calls mimic its start-up (stages/talker/cuda_graphs.py): its first layer's input and the attention
kernel's output are views, the step's output rows a slice of a buffer as large as the largest batch bucket, and a
batch that equals a weight's or a buffer's size."""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from stages import dynamic_compile
from stages.dynamic_compile import compile_dynamic
from stages.layers import attention_output_and_mlp, heads_norm_rope
from stages.talker.frame import advance_rows, record_step

HIDDEN, HEADS_DIM, INNER = 32, 48, 64


@pytest.fixture
def traced(monkeypatch):
    """-> a function that says how many graphs Dynamo traced since the fixture began (AOT eager backend)."""
    monkeypatch.setattr(dynamic_compile.torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    yield lambda: counters["stats"]["unique_graphs"] - start
    torch._dynamo.reset()


def _layer_weights(generator: torch.Generator) -> dict:
    def w(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=generator) * 0.1, requires_grad=False)

    return {"o_w": w(HIDDEN, HEADS_DIM), "norm_w": w(HIDDEN), "eps": 1e-6,
            "gate_up_w": (torch.randn(2 * INNER, HIDDEN, generator=generator) * 0.1,), "down_w": w(HIDDEN, INNER)}


@torch.no_grad()  # as the engines capture (inference mode keeps no `_base`)
def test_views_of_any_base_and_fresh_tensors_share_one_trace(traced):
    """The attention output as a view of a kernel's output buffer (of two sizes), then as a fresh tensor: one trace
    (torch.compile alone traces two: its guards read the view's base)."""
    g = torch.Generator().manual_seed(0)
    weights = _layer_weights(g)
    post = compile_dynamic(attention_output_and_mlp)
    for batch, base_rows in ((4, 4), (3, 9), (5, None)):
        x = torch.randn(batch, 2, HIDDEN, generator=g)
        attn = torch.randn(batch, 2, HEADS_DIM, generator=g)
        if base_rows is not None:  # the rows of a larger buffer, reshaped: a view
            buffer = torch.cat([attn.view(batch * 2, HEADS_DIM), torch.zeros((base_rows - batch + 1) * 2, HEADS_DIM)])
            attn = buffer[:batch * 2].view(batch, 2, HEADS_DIM)
        assert (attn._base is not None) == (base_rows is not None)
        got = post(x, attn, **weights)
        torch.testing.assert_close(got, attention_output_and_mlp(x, attn.clone(), **weights))
    assert traced() == 1


@torch.no_grad()  # as the engines capture (inference mode keeps no `_base`)
def test_q_k_v_split_from_one_product_share_one_trace_at_every_batch(traced):
    """The few-row path's q, k and v: three views of one GEMV output (detached: three aliases of one storage), at
    several batch sizes, one trace, the eager function's result."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim = 4, 2, 8
    sizes = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    q_norm, k_norm = torch.nn.Parameter(torch.rand(head_dim, generator=g)), torch.nn.Parameter(
        torch.rand(head_dim, generator=g))
    fn = compile_dynamic(heads_norm_rope)
    for batch in (4, 2, 3):
        projected = torch.randn(batch, 1, sum(sizes), generator=g)
        q, k, v = projected.split(sizes, -1)
        cos, sin = torch.rand(batch, 1, 1, head_dim, generator=g), torch.rand(batch, 1, 1, head_dim, generator=g)
        args = (q_norm, k_norm, 1e-6, cos, sin, heads, kv_heads, head_dim)
        for got, want in zip(fn(q, k, v, *args), heads_norm_rope(q.clone(), k.clone(), v.clone(), *args), strict=True):
            torch.testing.assert_close(got, want)
    assert traced() == 1


@torch.no_grad()  # as the engines capture (inference mode keeps no `_base`)
def test_a_batch_as_large_as_its_buffer_is_no_variant_of_its_own(traced):
    """The step's output rows, `out[:b]`, first at the largest bucket (b equal to the buffer's rows: duck shaping tied
    the two sizes), then at smaller ones; the writes land in the buffer and the codes' tensor."""
    rows, slots = 6, 6
    out = torch.zeros(slots, 17, dtype=torch.long)
    c0 = torch.zeros(slots, dtype=torch.long)
    step = compile_dynamic(record_step)
    for b in (rows, 4, 3):
        next_c0 = torch.arange(b) + 10 * b
        step(out[:b], c0[:b], next_c0)
        assert torch.equal(out[:b, 16], next_c0) and torch.equal(c0[:b], next_c0)
    assert traced() == 1


@torch.no_grad()  # as the engines capture (inference mode keeps no `_base`)
def test_in_place_writes_through_views_land_in_the_rows_under_inductor():
    """CPU Inductor: `advance_rows` on slices of the runner's row tensors writes them in place, as the eager function
    does, at two batch sizes of one trace."""
    torch._dynamo.reset()
    start = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(1)
    rows, vocab = 8, 40
    state = {"positions": torch.randint(0, 30, (rows,), generator=g), "frame_index": torch.randint(0, 9, (rows,),
             generator=g), "seen": torch.zeros(rows, vocab, dtype=torch.bool)}
    expected = {k: v.clone() for k, v in state.items()}
    advance = compile_dynamic(advance_rows)
    for b in (5, 3):
        c0 = torch.randint(0, vocab, (b,), generator=g)
        advance(state["positions"][:b], state["frame_index"][:b], state["seen"][:b], c0, 31)
        advance_rows(expected["positions"][:b], expected["frame_index"][:b], expected["seen"][:b], c0, 31)
        for name in state:
            assert torch.equal(state[name], expected[name]), name
    assert counters["stats"]["unique_graphs"] - start == 1
    torch._dynamo.reset()
