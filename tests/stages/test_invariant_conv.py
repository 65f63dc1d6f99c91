"""The batch-invariant convolutions (stages/invariant_conv.py) on CPU, the override registered for the CPU key: they
equal aten's convolutions on every conv of the (tiny) codec decoder in each form its decode paths issue them (eager
Conv1d / ConvTranspose1d, the stateful decoder's F.conv_transpose1d, the fused vocoder's channels-last height-1 and
(time / d, d) 2-D views), over ragged slabs; a row's output is bit-identical at every position of the batch and
whatever the other rows hold; torch.compile'd convolutions reach the override; enable/disable are refcounted. The
engine in deterministic mode: tests/stages/test_deterministic_code2wav.py; on CUDA (bf16, graphs, compile):
tests/stages/gpu/test_deterministic_code2wav_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stages import invariant_conv
from stages.code2wav import fast
from tests.triton_interpreter import run_interpreted


def has_cpu_override() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::convolution", "CPU")


@pytest.fixture
def cpu_override(monkeypatch):
    """The override on the CPU key, counting its calls; small slabs (several per conv, the last one shorter)."""
    calls = []
    original = invariant_conv.convolution

    def counted(*args):
        calls.append(args[6])  # transposed
        return original(*args)

    monkeypatch.setattr(invariant_conv, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(invariant_conv, "convolution", counted)
    monkeypatch.setattr(invariant_conv, "SLAB_ELEMENTS", 20_000)
    fallbacks = invariant_conv.fallbacks
    yield calls
    assert not invariant_conv.enabled() and not has_cpu_override()
    assert invariant_conv.fallbacks == fallbacks, "a decoder convolution went to aten's kernel"


@pytest.fixture(scope="module")
def decoder(tiny_custom_voice):
    from stages.qwen3_tts import Qwen3TTS

    return Qwen3TTS.load(tiny_custom_voice, "cpu", "float32", talker=False, decoder=True, voice=False).decoder


def _time_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def decoder_forms(decoder) -> list[tuple[str, nn.Module, callable]]:
    """(name, module, f(x) -> conv output) for every convolution of the decoder, in each form a decode path issues
    it; x is [B, C_in, T] with T a multiple of 9 (and over 6 x 9) (every dilation divides it)."""
    forms = []
    for name, m in decoder.named_modules():
        if name.startswith("quantizer") and "input_proj" in name:
            continue  # encoder side, never run
        if isinstance(m, nn.Conv1d):
            forms.append((name, m, m))  # eager modules, stateful `_Rows.conv`, the compiled quantizer's k=1 conv
            if m.groups == 1:
                forms.append((f"{name} fast.conv", m, lambda x, m=m: fast.conv(_time_major(x), m, m.bias)))
                if m.dilation[0] > 1:
                    forms.append((f"{name} fast.dilated_view_conv", m,
                                  lambda x, m=m: fast.dilated_view_conv(_time_major(x), m)))
        elif isinstance(m, nn.ConvTranspose1d):
            forms.append((name, m, m))
            forms.append((f"{name} F.conv_transpose1d", m,  # the stateful decoder's `_up`
                          lambda x, m=m: F.conv_transpose1d(x, m.weight, m.bias, stride=m.stride[0])))
            forms.append((f"{name} fast.conv_transpose", m, lambda x, m=m: fast.conv_transpose(_time_major(x), m)))
    return forms


def test_equals_aten_on_every_decoder_convolution(decoder, cpu_override):
    forms = decoder_forms(decoder)
    kinds = {(m.groups > 1, isinstance(m, nn.ConvTranspose1d), getattr(m, "dilation", (1,))[0] > 1)
             for _, m, _ in forms}
    assert kinds >= {(False, False, False), (False, False, True), (True, False, False), (False, True, False)}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, m, f in forms:
            x = torch.randn(3, m.in_channels, 90, generator=gen)
            want = f(x)
            assert not cpu_override
            with invariant_conv.invariant_conv():
                got = f(x)
            assert cpu_override == [isinstance(m, nn.ConvTranspose1d)], name  # one call, through the override
            cpu_override.clear()
            assert got.shape == want.shape and got.stride() == want.stride(), name
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 2e-6 * max(scale, 1.0), name  # fp32: summation order only


@pytest.mark.parametrize("slab", [20_000, 1 << 27], ids=["ragged-slabs", "one-slab"])
def test_a_row_is_bit_identical_at_any_position_beside_anything(decoder, cpu_override, monkeypatch, slab):
    monkeypatch.setattr(invariant_conv, "SLAB_ELEMENTS", slab)
    gen = torch.Generator().manual_seed(1)
    batch = 8
    with torch.no_grad(), invariant_conv.invariant_conv():
        for name, m, f in decoder_forms(decoder):
            probe = torch.randn(1, m.in_channels, 90, generator=gen)
            alone = f(torch.cat([probe, torch.zeros(batch - 1, m.in_channels, 90)]))[0]
            for row in (1, 3, batch - 1):
                crowd = torch.randn(batch, m.in_channels, 90, generator=gen) * 10
                crowd[row] = probe[0]
                assert torch.equal(f(crowd)[row], alone), (name, row)


@pytest.mark.slow  # Triton's interpreter in its venv
def test_the_cuda_window_kernel_equals_aten_and_keeps_rows_apart():
    """The CUDA path (stages/window_product.py, no im2col) under Triton's interpreter, fp32 on CPU: one dense and
    transposed convolution of the tiny decoder per decode form, dilation and kernel size, plus padding, stride,
    dilation, a 1-channel output and crops that are not whole blocks, equal aten's within fp32 summation order; a
    probe row's output is bit-identical alone and at rows 1, 3 and 7 of a batch of 8; nothing fell back to aten."""
    result = run_interpreted("window_product.py")
    assert result["forms"] >= 15 and result["fallbacks"] == 0
    assert max(result["max_rel_err"].values()) <= 2e-6, result["max_rel_err"]
    assert all(result["rows_identical"].values()), result["rows_identical"]


def test_compiled_convolutions_go_through_the_override(cpu_override):
    def f(x, w, b, wd, wt):
        y = F.conv1d(x, w, b, dilation=3)
        y = F.conv1d(y, wd, None, groups=y.shape[1])
        z = F.conv2d(y.unsqueeze(2).contiguous(memory_format=torch.channels_last), w[:, :, None, :3])
        return F.conv_transpose1d(z.squeeze(2), wt, stride=4)

    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(2, 6, 40, generator=gen), torch.randn(6, 6, 7, generator=gen), torch.randn(6, generator=gen)
    wd, wt = torch.randn(6, 1, 5, generator=gen), torch.randn(6, 3, 8, generator=gen)
    with torch.no_grad():
        want = f(x, w, b, wd, wt)
        with invariant_conv.invariant_conv():
            eager = f(x, w, b, wd, wt)
            cpu_override.clear()
            compiled = torch.compile(f, dynamic=True, fullgraph=True)
            got = compiled(x, w, b, wd, wt)  # Inductor's size/stride asserts pass on the override's outputs
            assert cpu_override == [False, False, False, True]
            x2 = torch.randn(3, 6, 52, generator=gen)
            assert torch.allclose(compiled(x2, w, b, wd, wt), f(x2, w, b, wd, wt), atol=1e-4)
    assert torch.allclose(got, want, atol=1e-4) and torch.allclose(eager, want, atol=1e-4)


def test_enable_disable_are_refcounted(monkeypatch):
    monkeypatch.setattr(invariant_conv, "DEVICE_TYPES", ("cpu",))
    assert not has_cpu_override()
    invariant_conv.enable()
    invariant_conv.enable()
    try:
        assert has_cpu_override() and invariant_conv.enabled()
        invariant_conv.disable()
        assert has_cpu_override(), "one enable() still holds the override"
    finally:
        invariant_conv.disable()
    assert not has_cpu_override() and not invariant_conv.enabled()
    with pytest.raises(RuntimeError, match="without a matching enable"):
        invariant_conv.disable()
    assert invariant_conv.covers(torch.device("cpu")) and not invariant_conv.covers(torch.device("meta"))


def test_shapes_it_does_not_compute_go_to_aten(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 8, 20, generator=gen), torch.randn(6, 4, 3, generator=gen)  # groups=2, not depthwise
    before = invariant_conv.fallbacks
    got = invariant_conv.convolution(x, w, None, [1], [0], [1], False, [0], 2)
    assert invariant_conv.fallbacks == before + 1 and torch.equal(got, F.conv1d(x, w, groups=2))
