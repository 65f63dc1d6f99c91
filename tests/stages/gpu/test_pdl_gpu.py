"""Programmatic dependent launch (stages/pdl.py) across every Triton kernel of the decode step, on CUDA (sm_90+).

Each kernel launched with PDL may start while the one before it runs and must wait before it touches what that
one writes. A missing or misplaced wait shows as a result that differs from the same kernels launched plainly,
at least now and then: so the chain is captured in a CUDA graph and replayed on fresh inputs several times."""

from __future__ import annotations

import pytest
import torch

from stages import gemv_kernels, pdl, sampling_kernel
from stages.sampling import SamplingTensors
from stages.talker.paged_attention import contiguous_decode_attention, paged_decode_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("rows", [1, 2])
def test_step_kernels_chained_with_pdl_in_a_graph_equal_plain_launches(rows):
    """GEMV (norm + q/k/v) -> paged attention storing the new key/value (16 key splits + merge) -> GEMV (o +
    residual) -> contiguous-cache attention -> GEMV head in fp32 -> token selection (sampled rows): with PDL in a
    graph, bit-identical to plain launches, the caches included."""
    if not pdl.supported(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90+")
    gen = torch.Generator(device="cuda").manual_seed(0)
    dt, hidden, heads, n_kv, d, page, vocab = torch.bfloat16, 1024, 8, 2, 128, 16, 2048

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dt)

    qkv_w, o_w, head_w = randn(heads * d + 2 * n_kv * d, hidden, scale=hidden ** -0.5), \
        randn(hidden, heads * d, scale=(heads * d) ** -0.5), randn(vocab, hidden, scale=hidden ** -0.5)
    norm = ((torch.rand(hidden, generator=gen, device="cuda") + 0.5).to(dt), 1e-6)
    per = 8  # blocks per row: up to 128 keys
    pools = [randn(rows * per * page, n_kv, d) for _ in range(2)]
    table = torch.randperm(rows * per, device="cuda", generator=gen).view(rows, per)
    lens = torch.tensor([100 + 7 * r for r in range(rows)], device="cuda")
    cp_k, cp_v = randn(rows, n_kv, 16, d), randn(rows, n_kv, 16, d)
    cp_rows, cp_len = torch.arange(rows, device="cuda")[:, None], torch.tensor([9], device="cuda")
    params = SamplingTensors(torch.ones(rows, dtype=torch.bool, device="cuda"), torch.full((rows,), 0.9, device="cuda"),
                             torch.full((rows,), 50, device="cuda"), torch.ones(rows, device="cuda"))
    seeds, counters = torch.arange(rows, device="cuda") + 11, torch.zeros(rows, dtype=torch.long, device="cuda")
    x = randn(rows, hidden)

    def chain(use_pdl, k_pool, v_pool, k_cp, v_cp):
        qkv = gemv_kernels.gemv(x, qkv_w, norm=norm, pdl=use_pdl)
        q, k, v = qkv.split((heads * d, n_kv * d, n_kv * d), -1)
        new_kv = (k.reshape(rows, n_kv, d), v.reshape(rows, n_kv, d))
        attn = paged_decode_attention(q.reshape(rows, heads, d), k_pool, v_pool, table, lens, page, new_kv=new_kv,
                                      splits=16, pdl=use_pdl)
        h = gemv_kernels.gemv(attn.reshape(rows, -1), o_w, residual=x, pdl=use_pdl)
        q2 = gemv_kernels.gemv(h, qkv_w, norm=norm, pdl=use_pdl)[:, :heads * d].reshape(rows, heads, d)
        attn2 = contiguous_decode_attention(q2, k_cp, v_cp, cp_rows, cp_len, new_kv=new_kv, pdl=use_pdl)
        logits = gemv_kernels.gemv(attn2.reshape(rows, -1), head_w, norm=norm, out_dtype=torch.float32, pdl=use_pdl)
        return logits, sampling_kernel.select_tokens(logits, params, seeds, counters, pdl=use_pdl)

    caches = [t.clone() for t in (*pools, cp_k, cp_v)]
    chain(True, *caches)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, ids = chain(True, *caches)
    for step in range(6):
        x.copy_(randn(rows, hidden))
        counters.fill_(step * 16)
        plain = [t.clone() for t in (*pools, cp_k, cp_v)]
        for t, src in zip(caches, plain, strict=True):
            t.copy_(src)
        graph.replay()
        want_logits, want_ids = chain(False, *plain)
        torch.cuda.synchronize()
        assert torch.equal(logits, want_logits), step
        assert torch.equal(ids, want_ids), step
        for got, want in zip(caches, plain, strict=True):
            assert torch.equal(got, want), step
