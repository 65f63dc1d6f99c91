"""Runs under Triton's interpreter (tests/triton_interpreter.py): stages/invariant_conv.py with its CUDA path, the
window kernel of stages/window_product.py, on CPU in fp32, the override registered for the CPU key. On every
convolution of the tiny codec decoder, in each form its decode paths issue it (tests/stages/test_invariant_conv.py's
`decoder_forms`, one per form, convolution type, dilated or not and k = 1 or not), plus padded / strided /
unaligned-crop cases: the max relative error against aten's convolution,
and whether a probe row's output is bit-identical alone and at rows 1, 3 and 7 of a batch of 8 beside other rows.
Prints JSON."""

from __future__ import annotations

import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch
from torch import nn

from bench.code2wav import build_decoder
from stages import invariant_conv, window_product
from tests.stages.test_invariant_conv import decoder_forms

GEN = torch.Generator().manual_seed(0)


def main() -> None:
    assert window_product.available(torch.zeros(1))
    invariant_conv.DEVICE_TYPES = ("cpu",)
    calls = []
    original = window_product.windows_product

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    window_product.windows_product = counted
    decoder = build_decoder(True, "cpu", torch.float32)
    forms, kinds = [], set()
    for name, m, f in decoder_forms(decoder):  # one of each kind (the interpreter is slow): path x conv type x dilation
        kind = (name.split(" ", 1)[1] if " " in name else "module", type(m).__name__, m.dilation[0] > 1,
                m.kernel_size[0] == 1)
        if kind not in kinds:
            kinds.add(kind)
            forms.append((name, m, f))
    extra = [  # padding, stride, a crop that is not a whole number of blocks
        ("conv k5 s2 p3 d1", nn.Conv1d(12, 20, 5, stride=2, padding=3)),
        ("conv k3 d2 p2", nn.Conv1d(40, 8, 3, dilation=2, padding=2, bias=False)),
        ("conv to 1 channel", nn.Conv1d(24, 1, 7, padding=3)),
        ("transposed s3 k7 p2", nn.ConvTranspose1d(16, 12, 7, stride=3, padding=2)),
        ("transposed s2 k4 p2", nn.ConvTranspose1d(16, 12, 4, stride=2, padding=2, bias=False)),
    ]
    forms += [(name, m, m) for name, m in extra]
    errors, rows_identical, batch = {}, {}, 8
    with torch.no_grad():
        for name, m, f in forms:
            if getattr(m, "groups", 1) > 1:
                continue  # depthwise: elementwise, not this kernel (tests/stages/test_invariant_conv.py)
            x = torch.randn(3, m.in_channels, 90, generator=GEN)
            want = f(x)
            before = len(calls)
            with invariant_conv.invariant_conv():
                got = f(x)
                assert len(calls) == before + 1, name
                scale = want.abs().max().item()
                errors[name] = (got - want).abs().max().item() / max(scale, 1.0)
                assert got.shape == want.shape and got.stride() == want.stride(), name
                probe = torch.randn(1, m.in_channels, 90, generator=GEN)
                alone = f(probe)[0]
                same = True
                for row in (1, 3, batch - 1):
                    crowd = torch.randn(batch, m.in_channels, 90, generator=GEN) * 10
                    crowd[row] = probe[0]
                    same &= torch.equal(f(crowd)[row], alone)
                rows_identical[name] = same
    print(json.dumps({"forms": len(errors), "max_rel_err": errors, "rows_identical": rows_identical,
                      "fallbacks": invariant_conv.fallbacks}))


main()
