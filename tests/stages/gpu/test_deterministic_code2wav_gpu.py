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
