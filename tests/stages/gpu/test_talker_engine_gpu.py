"""The talker engine's CUDA paths: graphs, staged admission, the paged attention kernel, no hidden host sync.

Marked `gpu`: they run on the GPU machine (`python -m pytest -m gpu tests/stages`), CPU CI skips them.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stages.contract import FinishReason, SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.reference import ReferenceGenerator
from stages.talker.engine import TalkerEngine, TalkerEngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True)


@pytest.fixture(scope="module")
def cuda_model(tiny_custom_voice):
    return Qwen3TTS.load(tiny_custom_voice, device="cuda", dtype="float32", decoder=False)


@pytest.fixture(scope="module")
def prompts(cuda_model):
    m = cuda_model

    def p(text, speaker, language, **kw):
        return build_prompt(m.config, m.tokenizer, text, speaker=speaker, language=language, **kw)

    return [p("Hello there.", "ryan", "english"),
            p("A much longer sentence with quite a few more tokens than the first one has.", "vivian", "auto"),
            p("Short", "eric", "chinese", instruct="Whisper it."),
            p("Medium length text, with punctuation!", "aiden", "english", non_streaming_text=True),
            p("Another one.", "sohee", "korean")]


async def _codes(engine, request):
    stream = engine.add_request(request)
    chunks = [chunk async for chunk in stream]
    return np.concatenate([c.codes[c.context:] for c in chunks]), stream.finish_reason


def _run(engine, requests, stagger=False):
    async def main():
        async def one(i, r):
            if stagger:  # arrivals while others run: admissions between steps
                for _ in range(i):
                    await asyncio.sleep(0)
            return await _codes(engine, r)
        return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return asyncio.run(main())


@pytest.mark.parametrize("kernel", ["by-batch", "tensor-cores"])
@pytest.mark.parametrize("write", [False, True], ids=["read", "store-new-kv"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("b,splits", [(37, 1), (96, 1), (256, 1),  # the three tilings (rows < 64, < 128, >= 128)
                                      (1, 16), (4, 4), (8, 2)])  # attention_splits' batches (decode_splits)
def test_paged_kernel_matches_gather_attention(dtype, atol, b, splits, write, kernel):
    """The Triton paged decode attention against gather + SDPA on scattered blocks and uneven lengths. With
    `write`, the kernel also stores each row's new key/value at its last position (what the engine runs): the
    pool must then equal an index_copy of them, bit for bit. With `splits`, each row's keys are split over that
    many programs (only the one holding the last position stores the new key: a race otherwise). `kernel`: the
    engine's tiling for the batch (decode_tiling), or the tensor-core kernel at every batch."""
    from stages.talker.paged_attention import DecodeTiling, paged_decode_attention

    tiling = DecodeTiling(64, 4, 3, tensor_cores=True) if kernel == "tensor-cores" else None

    torch.manual_seed(0)
    heads, n_kv, d, page, blocks = 16, 8, 128, 16, 8000
    k_pool = torch.randn(blocks * page, n_kv, d, device="cuda", dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    lens = torch.randint(1, 400, (b,), device="cuda")
    lens[0], lens[-1] = 1, 399  # (batch 1: one row of 399)
    per = -(-400 // page)
    table = torch.randperm(blocks, device="cuda")[:b * per].view(b, per)  # scattered, not contiguous
    q = torch.randn(b, heads, d, device="cuda", dtype=dtype)
    if write:
        # new k/v as the layer makes them: [b, n_kv, D] views with a row stride wider than n_kv * D
        k_new, v_new = torch.randn(2, b, 3, n_kv, d, device="cuda", dtype=dtype).unbind(0)
        k_new, v_new = k_new[:, 1], v_new[:, 2]
        last = lens - 1
        index = table[torch.arange(b, device="cuda"), last // page] * page + last % page
        expected_k, expected_v = k_pool.clone().index_copy_(0, index, k_new), v_pool.clone().index_copy_(0, index, v_new)
        out = paged_decode_attention(q, k_pool, v_pool, table, lens, page, tiling, new_kv=(k_new, v_new),
                                     splits=splits)
        assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)
    else:
        out = paged_decode_attention(q, k_pool, v_pool, table, lens, page, tiling, splits=splits)
    keys = torch.arange(per * page, device="cuda")
    index = table[:, keys // page] * page + keys % page  # [b, L]
    k, v = k_pool[index].float().transpose(1, 2), v_pool[index].float().transpose(1, 2)
    mask = (keys[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.float().reshape(b, n_kv, heads // n_kv, d), k, v, attn_mask=mask)
    err = (out.float() - ref.reshape(b, heads, d)).abs().max().item()
    print(f"paged kernel ({kernel}) vs gather, {dtype}, {b} rows, {splits} splits, write {write}: max abs err {err:.2e}")
    assert err <= atol


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 256])
def test_code_predictor_cache_kernel_matches_sdpa(dtype, atol, rows):
    """The code predictor's contiguous cache with the decode kernel against SDPA, at every length 1..16: the
    two-row causal first step (one kernel call per row) and the one-row steps after it."""
    from stages.layers import Attention
    from stages.talker.contiguous_kv import ContiguousKV

    torch.manual_seed(0)
    heads, n_kv, d, layers = 16, 8, 128, 2
    cfg = type("Cfg", (), dict(num_attention_heads=heads, num_key_value_heads=n_kv, head_dim=d, hidden_size=64,
                               rms_norm_eps=1e-6))
    attn = Attention(cfg, 1)
    caches = [ContiguousKV(layers, rows, n_kv, d, 16, dtype, "cuda", decode_kernel=k) for k in (True, False)]
    assert caches[0].decode_kernel and not caches[1].decode_kernel
    worst = 0.0
    for n in range(16):
        s = 2 if n == 0 else 1  # the first step writes two positions (causal), then one at a time
        q = torch.randn(rows, heads, s, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(rows, n_kv, s, d, device="cuda", dtype=dtype) for _ in range(2))
        outs = []
        for cache in caches:
            cache.begin(s)
            outs.append(attn.attend(q, k, v, cache).float())
            cache.advance()
        worst = max(worst, (outs[0] - outs[1]).abs().max().item())
        if caches[0].length == 16:
            break
    print(f"code predictor decode kernel vs SDPA, {dtype}, {rows} rows: max abs err {worst:.2e}")
    assert worst <= atol


@pytest.mark.parametrize("exact_prefill,kernel", [(True, False), (False, False), (False, True)],
                         ids=["reference-prefill+gather", "staged-prefill-graphs+gather", "staged+paged-kernel"])
def test_graphed_engine_equals_reference_on_cuda(cuda_model, prompts, exact_prefill, kernel):
    """fp32, decode graphs (and prefill graphs when staged), padding rows in the scratch row: same greedy codes
    as the reference generator."""
    engine = TalkerEngine(cuda_model, TalkerEngineConfig(max_seq_len=256, max_num_seqs=8, compile=False, kernels={
        "exact_prefill": exact_prefill, "attention_kernel": kernel}))
    engine.start(log=lambda _m: None)
    try:
        assert engine.runner.graphs and engine.runner.prefill_graphs and engine.runner.use_kernel is kernel
        lengths = [12, 20, 7, 15, 11]
        results = _run(engine, [SynthesisRequest(f"r{i}", p, GREEDY, n)
                                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))], stagger=True)
    finally:
        engine.shutdown()
    reference = ReferenceGenerator(cuda_model)
    for prompt, n, (codes, reason) in zip(prompts, lengths, results, strict=True):
        assert reason is FinishReason.LENGTH
        np.testing.assert_array_equal(codes, reference.generate_codes(prompt, GREEDY, n))


@pytest.mark.parametrize("fused", [False, True],
                         ids=["gemv", "gemv+pdl+heads-in-attention+sampling-kernel+attention-splits"])
def test_compiled_engine_with_gemv_rows_equals_reference_on_cuda(cuda_model, prompts, fused):
    """fp32, the serving path: compiled layers, paged kernel, graphs, and the batch 1-2 buckets on the Triton GEMVs
    (stages/gemv_kernels.py; `gemv_rows`), optionally launched with programmatic dependent launch, with q/k's head
    norm and RoPE in the attention kernel, token selection as one kernel and a few rows' keys split over more
    programs: the same greedy codes as the reference generator, requests joining and leaving so that steps of 1,
    2 and more rows all run."""
    engine = TalkerEngine(cuda_model, TalkerEngineConfig(max_seq_len=256, max_num_seqs=8, compile=True, pdl=fused, kernels={
        "gemv_rows": 4, "heads_in_attention": fused, "sampling_kernel": fused, "attention_splits": fused}))
    engine.start(log=lambda _m: None)
    try:
        assert engine.runner.gemv_rows == 4 and engine.runner.graphs
        assert engine.runner.heads_in_attention is fused and engine.runner.sampling_kernel is fused
        assert engine.runner.attention_splits is fused
        lengths = [12, 20, 7, 15, 11]
        results = _run(engine, [SynthesisRequest(f"g{i}", p, GREEDY, n)
                                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))], stagger=True)
        alone = _run(engine, [SynthesisRequest("alone", prompts[1], GREEDY, 9)])  # batch 1 throughout
    finally:
        engine.shutdown()
    reference = ReferenceGenerator(cuda_model)
    for prompt, n, (codes, reason) in zip([*prompts, prompts[1]], [*lengths, 9], [*results, *alone], strict=True):
        assert reason is FinishReason.LENGTH
        np.testing.assert_array_equal(codes, reference.generate_codes(prompt, GREEDY, n))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_head_norm_in_the_kernel_matches_eager_heads(dtype, atol):
    """The decode kernel given projected q/k and a HeadNorm against heads_norm_rope then the kernel, at the
    talker's head shapes: the output and the stored key (bf16: the kernel rounds where the eager ops round)."""
    from stages.layers import Rotary, heads_norm_rope
    from stages.talker.paged_attention import HeadNorm, paged_decode_attention

    torch.manual_seed(0)
    b, h, n_kv, d, page, per = 64, 16, 8, 128, 16, 8
    rotary = Rotary(d, 1e6).to("cuda")
    positions = torch.randint(1, per * page, (b, 1), device="cuda")
    cos, sin = rotary(positions, dtype)
    qn_w, kn_w = (torch.rand(d, device="cuda") + 0.5).to(dtype), (torch.rand(d, device="cuda") + 0.5).to(dtype)
    qkv = torch.randn(b, 1, (h + 2 * n_kv) * d, device="cuda").to(dtype)
    q, k, v = qkv.split((h * d, n_kv * d, n_kv * d), -1)
    q_rot, k_rot, v_ref = heads_norm_rope(q, k, v, qn_w, kn_w, 1e-6, cos, sin, h, n_kv, d)
    q_raw, k_raw, v_raw = (t.view(b, 1, n, d).transpose(1, 2) for t, n in ((q, h), (k, n_kv), (v, n_kv)))
    blocks = b * per + 1
    pool = torch.randn(blocks * page, n_kv, d, device="cuda").to(dtype)
    table = torch.randperm(blocks, device="cuda")[:b * per].view(b, per)
    lens = positions[:, 0] + 1
    k_ref, k_got = pool.clone(), pool.clone()
    ref = paged_decode_attention(q_rot[:, :, 0], k_ref, pool.clone(), table, lens, page,
                                 new_kv=(k_rot[:, :, 0], v_ref[:, :, 0]))
    got = paged_decode_attention(q_raw[:, :, 0], k_got, pool.clone(), table, lens, page,
                                 new_kv=(k_raw[:, :, 0], v_raw[:, :, 0]), head_norm=HeadNorm(qn_w, kn_w, 1e-6, cos, sin))
    err_out = (got.float() - ref.float()).abs().max().item()
    err_k = (k_got.float() - k_ref.float()).abs().max().item()
    print(f"head norm in the kernel vs eager heads, {dtype}: out max abs err {err_out:.2e}, stored key {err_k:.2e}")
    assert err_out <= atol and err_k <= atol * 4


def test_hot_path_has_no_host_sync(cuda_model, prompts):
    """Arrivals, steps and releases under `set_sync_debug_mode("error")`: any hidden sync raises in the engine."""
    engine = TalkerEngine(cuda_model, TalkerEngineConfig(max_seq_len=256, max_num_seqs=4, compile=False))
    engine.start(log=lambda _m: None)
    try:
        _run(engine, [SynthesisRequest("warm", prompts[0], GREEDY, 3)])  # first-use allocations outside the check
        torch.cuda.set_sync_debug_mode("error")
        try:
            requests = [SynthesisRequest(f"s{i}", prompts[i % len(prompts)], GREEDY, 6 + 3 * i) for i in range(7)]
            results = _run(engine, requests, stagger=True)  # 7 requests through 4 rows: queueing, joins, leaves
        finally:
            torch.cuda.set_sync_debug_mode("default")
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert [len(codes) for codes, _ in results] == [6 + 3 * i for i in range(7)]
    assert all(reason is FinishReason.LENGTH for _, reason in results)
    assert stats.running == 0 and stats.kv_reserved_tokens == 0


def test_live_text_parks_on_cuda_give_the_whole_text_codes_without_a_host_sync(cuda_model):
    """Three live requests fed a token at a time, each waiting (parked) before every token, so that parks and
    unparks of several rows share iterations (stages/talker/row_copies.py), on the graphed engine under
    `set_sync_debug_mode("error")`: each gets the reference generator's codes for its text sent whole."""
    from stages.prompts import build_live_prompt

    m, frames = cuda_model, 24
    texts = ["Hello there, friend.", "A longer sentence for the second.", "Third one here."]
    live = build_live_prompt(m.config, m.tokenizer, speaker="ryan", language="english")
    engine = TalkerEngine(m, TalkerEngineConfig(max_seq_len=256, max_num_seqs=4, compile=False))
    engine.start(log=lambda _m: None)

    async def feed(request_id: str, text: str) -> None:
        sched = engine.scheduler
        for i in m.tokenizer.encode(text):
            await asyncio.wrap_future(engine.run_on_device(lambda: None))  # the last piece was handled
            while request_id not in sched.held and request_id not in sched.parked and sched.get(request_id):
                await asyncio.sleep(0.001)  # until it has caught up with its text (or ended)
            if sched.get(request_id) is None:
                return  # it ended (max frames) before its text did
            engine.append_text(request_id, m.tokenizer._tok.decode([i]))
        engine.end_text(request_id)

    async def main():
        streams = [engine.open_request(SynthesisRequest(f"l{k}", live, GREEDY, frames)) for k in range(3)]
        feeders = [asyncio.create_task(feed(f"l{k}", t)) for k, t in enumerate(texts)]
        codes = [np.concatenate([c.codes[c.context:] async for c in s]) for s in streams]
        await asyncio.gather(*feeders)
        return codes

    try:
        asyncio.run(_codes_of_one(engine, live))  # first-use allocations (and a first park) outside the check
        torch.cuda.set_sync_debug_mode("error")
        try:
            codes = asyncio.run(main())
        finally:
            torch.cuda.set_sync_debug_mode("default")
        parks = engine.counters.parks
    finally:
        engine.shutdown()
    reference = ReferenceGenerator(m)
    for text, got in zip(texts, codes, strict=True):
        whole = build_prompt(m.config, m.tokenizer, text, speaker="ryan", language="english", non_streaming_text=False)
        np.testing.assert_array_equal(got, reference.generate_codes(whole, GREEDY, frames))
    assert parks >= 2 * len(texts)  # each waited for its next word at least twice (its words release one by one)


async def _codes_of_one(engine, live_prompt) -> None:
    stream = engine.open_request(SynthesisRequest("warm", live_prompt, GREEDY, 4), text="Hi")
    engine.append_text("warm", " there")
    engine.end_text("warm")
    [c async for c in stream]


@pytest.mark.parametrize("fused", [False, True], ids=["separate-projections", "fused-projections"])
@pytest.mark.parametrize("dtype,rtol", [("float32", 1e-5), ("bfloat16", 2e-2)])  # H100: 1.2e-7, 0.8% (1 ulp)
def test_compiled_layer_kernels_match_eager_on_prompt_shapes(tiny_custom_voice, dtype, rtol, fused):
    """What the prefill graphs now run: the talker's compiled layer kernels (dynamic shapes: one variant for a
    single row, one for every batch and width above it) against its eager layers, at prompt shapes; with
    `fused`, q/k/v and gate/up as one product each (what the engine runs). The error is stated relative to the
    largest hidden value."""
    from stages.layers import LayerKernels
    from stages.talker.contiguous_kv import ContiguousKV

    torch._dynamo.reset()  # each parametrization compiles anew (Dynamo's recompile limit counts across them)
    model = Qwen3TTS.load(tiny_custom_voice, device="cuda", dtype=dtype, decoder=False)
    stack, cfg = model.talker.model, model.talker.model.config
    if fused:
        stack.fuse_projections()  # the eager path keeps the separate products
    kernels = LayerKernels.compiled()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for b, s in [(1, 16), (1, 98), (5, 37), (16, 64), (16, 128)]:
        x = torch.randn(b, s, cfg.hidden_size, generator=gen, device="cuda").to(model.dtype)
        positions = torch.arange(s, device="cuda").expand(b, s)
        out = {}
        for name, k in (("eager", None), ("compiled", kernels)):
            stack.kernels = k
            kv = ContiguousKV(cfg.num_hidden_layers, b, cfg.num_key_value_heads, cfg.head_dim, s, model.dtype, "cuda")
            kv.begin(s)
            with torch.no_grad():
                out[name] = stack(x, positions, kv).float()
        stack.kernels = None
        scale = out["eager"].abs().max().item()
        err = (out["compiled"] - out["eager"]).abs().max().item()
        print(f"compiled vs eager layers, {dtype}, fused {fused}, batch {b} x {s}: max abs err {err:.2e} "
              f"(max |h| {scale:.2f})")
        assert err <= rtol * max(scale, 1.0), (b, s, err, scale)
