"""Code2Wav's deterministic mode on CUDA (the released decoder's shapes, random weights, bf16): a probe stream's PCM is
bit-identical at rows 0, 1, 15, 32 and 63 of full 64-row forwards and alone, with CUDA graphs and torch.compile (the
serving configuration), on the fused kernels without them, and on the eager modules; and it stays close to the
default engine's PCM. cuDNN computed a row by its place in the batch at one fixed shape; the deterministic engine
takes its convolutions through stages/invariant_conv.py (products), which this checks end to end, and that no
convolution of the decode fell back to aten's kernels. The same comparison on a checkpoint:
`python -m bench.seeded_determinism` ("row_r" in "pcm_alone_vs_batch").

Marked `gpu`: `python -m pytest -m gpu -s tests/stages/gpu/test_deterministic_code2wav_gpu.py`; CPU CI skips it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.code2wav import build_decoder
from bench.seeded_determinism import pcm_by_row, stream_chunks
from stages import invariant_conv
from stages.chunking import ChunkSchedule
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROWS = (0, 1, 15, 32, 63)
MODES = {"graphs+compile": {}, "fused, eager": dict(cuda_graphs=False, compile=False),
         "modules, eager": dict(cuda_graphs=False, compile=False, fast_kernels=False)}


@pytest.fixture(scope="module")
def decoder():
    return build_decoder(False, "cuda", torch.bfloat16)


def _engine(decoder, deterministic: bool, **kwargs) -> Code2WavEngine:
    engine = Code2WavEngine(decoder, Code2WavEngineConfig.for_schedule(
        ChunkSchedule(), max_batch_size=64, state_slots=1024, deterministic=deterministic, **kwargs))
    engine.warmup(lambda _m: None)
    return engine


def _snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    noise = float(np.sum((ref - out) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref ** 2)) / noise)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_probe_decodes_alike_at_every_row_of_a_full_forward(decoder, mode, monkeypatch):
    calls = []
    convolution = invariant_conv.convolution
    monkeypatch.setattr(invariant_conv, "convolution", lambda *a: calls.append(1) or convolution(*a))
    fallbacks = invariant_conv.fallbacks
    probe = np.random.default_rng(0).integers(0, 2048, (40, 16))
    engine = _engine(decoder, True, **MODES[mode])
    assert engine.invariant_convs and all(b == 64 for b, _ in engine.graph_shapes())
    rows = pcm_by_row(engine, probe, ROWS, 64)
    alone = np.concatenate([engine.decode([c])[0] for c in stream_chunks(ChunkSchedule(), "alone", probe)])
    print(json.dumps({"mode": mode, **rows}))
    assert calls and invariant_conv.fallbacks == fallbacks and not invariant_conv.enabled()
    assert rows == {f"row_{r}": "identical" for r in ROWS}
    del engine
    torch.cuda.empty_cache()
    default = _engine(decoder, False, **MODES[mode])
    reference = np.concatenate([default.decode([c])[0] for c in stream_chunks(ChunkSchedule(), "ref", probe)])
    diff, snr = float(np.abs(alone - reference).max()), _snr_db(reference, alone)
    print(json.dumps({"mode": mode, "max_diff_vs_default": diff, "snr_db_vs_default": snr}))
    assert diff <= 3e-2 and snr > 30  # bf16: the engine's graphed-vs-eager tolerance (test_code2wav_engine.py)
    del default
    torch.cuda.empty_cache()


def test_compiled_and_graphed_convolutions_reach_the_override(monkeypatch):
    """Inductor's extern convolution calls dispatch to the override at run time, also while a CUDA graph captures
    them: the replay equals the compiled function run outside a graph bit for bit, and both the eager override up to
    the order of the k taps (Inductor may lay a weight out channels-last)."""
    import torch.nn.functional as F

    calls = []
    convolution = invariant_conv.convolution
    monkeypatch.setattr(invariant_conv, "convolution", lambda *a: calls.append(a[6]) or convolution(*a))

    def f(x, w, wd, wt):
        y = F.conv1d(x, w, dilation=3)
        y = F.conv1d(y, wd, groups=y.shape[1])
        z = F.conv2d(y.unsqueeze(2).contiguous(memory_format=torch.channels_last), w[:, :, None, :3])
        return F.conv_transpose1d(z.squeeze(2), wt, stride=4)

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, 300, generator=gen, device="cuda", dtype=torch.bfloat16)
    w, wd = (torch.randn(*s, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.05 for s in ((256, 256, 7),
                                                                                                 (256, 1, 7)))
    wt = torch.randn(256, 128, 8, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.05
    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    with torch.no_grad(), invariant_conv.invariant_conv():
        eager = f(x, w, wd, wt)
        calls.clear()
        got = compiled(x, w, wd, wt)
        assert calls == [False, False, False, True]
        assert torch.allclose(got.float(), eager.float(), rtol=2e-2, atol=2e-2 * eager.abs().max().item())
        static = x.clone()
        compiled(static, w, wd, wt)  # warm on the capture's shapes
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = compiled(static, w, wd, wt)
    x2 = torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    static.copy_(x2)
    graph.replay()
    replayed = out.clone()
    with torch.no_grad(), invariant_conv.invariant_conv():
        assert torch.equal(replayed, compiled(x2, w, wd, wt))
