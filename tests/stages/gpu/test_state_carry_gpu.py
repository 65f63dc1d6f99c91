"""The stateful decode's carry kernel (stages/code2wav/state_carry.py) on the GPU against the PyTorch path it replaces
(`stateful._Rows.carry_with_torch_ops`), at the
released decoder's state widths and channel counts and a serving batch: 256 rows over 576 slots, a third of them
fresh, padding rows on the scratch slot, rows with fewer new samples than state columns. Bits are copied, so the
two must be equal exactly; with many programs in flight a missing barrier or a wrong slot would show."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from stages.code2wav import state_carry
from stages.code2wav.stateful import _Rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


# (state columns, channels, samples per frame at that conv) of the released decoder's carried convs
SHAPES = [(6, 1024, 4), (1, 1536, 4), (6, 768, 32), (18, 768, 32), (54, 768, 32), (1, 768, 32), (54, 384, 160),
          (54, 192, 640), (54, 96, 1920), (6, 96, 1920)]


@pytest.mark.parametrize(("n", "channels", "rate"), SHAPES)
def test_the_kernel_equals_the_pytorch_path_at_serving_shapes(n, channels, rate):
    gen = torch.Generator(device="cuda").manual_seed(n * channels)
    slots_total, B, frames = 576, 256, 2
    state = torch.randn(slots_total + 1, channels, n, device="cuda", generator=gen).to(torch.bfloat16)
    slots = torch.randperm(slots_total, device="cuda", generator=gen)[:B]
    slots[-8:] = slots_total  # padding rows
    keep = torch.rand(B, device="cuda", generator=gen) > 0.33
    keep[-8:] = False
    # 0 samples is what a padding row's length may be; rate 4 x 1 frame is fewer samples than 6 state columns
    lengths = torch.randint(0, frames + 1, (B,), device="cuda", generator=gen)
    T = n + frames * rate + 3
    padded = torch.randn(B, T, channels, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
    padded[..., :n] = 0
    want_p, want_s = padded.clone(), state.clone()
    _Rows(SimpleNamespace(convs={"conv": want_s}), slots, ~keep, lengths).carry_with_torch_ops("conv", want_p, rate)
    got_p, got_s = padded.clone(), state.clone()
    assert got_p.stride(1) == 1 and state_carry.available(got_p.device)  # time-major as the fused vocoder's; the kernel
    _Rows(SimpleNamespace(convs={"conv": got_s}), slots, ~keep, lengths).carry_into("conv", got_p, rate)  # the kernel
    assert torch.equal(got_p, want_p)
    assert torch.equal(got_s[:slots_total], want_s[:slots_total])
