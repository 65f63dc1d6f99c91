"""The fused vocoder's time-major plumbing on CPU: convs as channels-last 2-D convs, k=1 convs as GEMMs, dilated
convs over the (time / d, d) view, state carried into each conv's zero columns. On CPU tensors the two Triton
kernels of stages/code2wav/fast.py run the same math in PyTorch, so everything but the kernels themselves is
checked here (the kernels: the GPU tests in test_code2wav_engine.py and test_code2wav_stateful.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from stages.chunking import ChunkSchedule, StreamChunker
from stages.code2wav import fast
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.contract import FinishReason


@pytest.fixture(scope="module")
def decoder(tiny_custom_voice):
    from stages.qwen3_tts import Qwen3TTS

    return Qwen3TTS.load(tiny_custom_voice, "cpu", "float32", talker=False, decoder=True, voice=False).decoder


@pytest.fixture
def fused(decoder):
    d = copy.deepcopy(decoder)
    d.kernels = fast.FusedVocoderKernels()  # enable_fast_kernels refuses CPU; the plumbing runs anyway
    return d


@pytest.mark.parametrize("gemm", [0, 10**6])  # every transposed conv as a GEMM + add, or none
@pytest.mark.parametrize("min_channels", [0, 10**6])  # every dilated conv on the (T / d, d) view, or none
def test_time_major_vocoder_equals_eager(decoder, fused, min_channels, gemm, monkeypatch):
    monkeypatch.setattr(fast, "CONV2D_MIN_CHANNELS", min_channels)
    monkeypatch.setattr(fast, "UPSAMPLE_GEMM_MIN_CHANNELS", gemm)
    codes = torch.from_numpy(np.random.default_rng(3).integers(0, 2048, (2, 16, 23)))
    with torch.inference_mode():
        want, got = decoder(codes), fused(codes)
    assert got.shape == want.shape
    assert float((got - want).abs().max()) < 1e-5


def test_layout_helpers_keep_channels_contiguous():
    x = torch.randn(2, 6, 9)
    tm = fast.time_major(x)
    assert torch.equal(tm, x) and tm.stride(1) == 1 and fast.time_major(tm) is tm
    conv = torch.nn.Conv1d(6, 4, 3, dilation=3)
    y = fast.dilated_conv(fast.time_major(torch.randn(2, 6, 12)), conv)
    assert y.stride(1) == 1 and y.shape == (2, 4, 6)
    padded = fast.pad_left(x, 3)
    assert padded.stride(1) == 1 and torch.equal(padded[..., 3:], x) and not padded[..., :3].any()


def test_time_major_weights_follow_a_weight_change():
    conv = torch.nn.Conv1d(4, 4, 1)
    x = fast.time_major(torch.randn(1, 4, 5))
    before = fast.pointwise(x, conv)
    with torch.no_grad():
        conv.weight.mul_(2)  # in place: the cached 2-D copy must not be reused
    assert torch.allclose(fast.pointwise(x, conv), 2 * before)


def test_upsample_is_the_trimmed_transposed_conv():
    torch.manual_seed(0)
    for r in (2, 3, 8):
        layer = torch.nn.ConvTranspose1d(6, 5, 2 * r, stride=r)
        x = torch.randn(2, 6, 7)  # the first sample: the previous chunk's last
        want = torch.nn.functional.conv_transpose1d(x, layer.weight, stride=r)[..., r:r + 6 * r]
        got = fast.upsample(fast.time_major(x), layer)
        assert got.stride(1) == 1 and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("gemm", [0, 10**6])
def test_stateful_time_major_streams_equal_the_whole_decode(decoder, fused, gemm, monkeypatch):
    monkeypatch.setattr(fast, "CONV2D_MIN_CHANNELS", 0)
    monkeypatch.setattr(fast, "UPSAMPLE_GEMM_MIN_CHANNELS", gemm)
    frames = np.random.default_rng(5).integers(0, 2048, (60, 16))
    with torch.inference_mode():
        whole = decoder(torch.from_numpy(frames).T[None])[0, 0].numpy()
    engine = Code2WavEngine(fused, Code2WavEngineConfig(stateful=True, state_slots=2, fast_kernels=False))
    fused.kernels = fast.FusedVocoderKernels()  # the engine turned them off (CPU): back on for the plumbing
    chunker = StreamChunker(ChunkSchedule(first_chunk_frames=1), "s")
    chunks = [*chunker.push(frames), chunker.flush(FinishReason.EOS)]
    out = np.concatenate([engine.decode([c])[0] for c in chunks])
    assert engine.stats().continued == len(chunks) - 1
    assert out.shape == whole.shape and np.abs(out - whole).max() < 1e-4
