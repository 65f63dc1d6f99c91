"""Runs under Triton's interpreter (tests/triton_interpreter.py): the state-carry kernel of
stages/code2wav/state_carry.py on CPU tensors against the PyTorch path it replaces (`stateful._Rows.
carry_with_torch_ops`, what CPU decodes run), over the carried convs'
shapes (1, 6, 18 and 54 state columns; channels that are and are not a multiple of the kernel's block), time-major
and channel-major inputs, rates 1 and 4, rows with fewer new samples than state columns, fresh rows, padding rows
sharing the scratch slot, and a slot holding NaN that only a fresh row is given. The kernel copies bits, so the two
must be equal exactly. Prints JSON: {case: {"padded_equal", "state_equal"}}."""

from __future__ import annotations

import json
from types import SimpleNamespace

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch

from stages.code2wav import state_carry
from stages.code2wav.stateful import _Rows

GEN = torch.Generator().manual_seed(0)


def case(n: int, channels: int, rate: int, time_major: bool, dtype: torch.dtype) -> dict:
    slots_total, new = 6, 3  # slots 0..5, scratch = 6; up to 3 new frames per row at `rate` samples each
    T = n + new * rate + 2  # two columns of right padding, as a dilated conv's input may have
    state = torch.randn(slots_total + 1, channels, n, generator=GEN).to(dtype)
    state[4] = float("nan")  # given to a fresh row below: must never reach its output
    # rows: kept slot 2 (3 new frames), kept slot 0 (1 frame: fewer samples than n when n > rate), fresh slot 4,
    # two padding rows on the scratch slot, kept slot 5 (2 frames)
    slots = torch.tensor([2, 0, 4, slots_total, slots_total, 5])
    keep = torch.tensor([True, True, False, False, False, True])
    lengths = torch.tensor([3, 1, 2, 1, 1, 2])
    B = len(slots)
    padded = torch.randn(B, channels, T, generator=GEN).to(dtype)
    padded[..., :n] = 0  # as the kernel ahead of the conv writes them
    if time_major:
        padded = padded.transpose(1, 2).contiguous().transpose(1, 2)
    want_s = state.clone()
    want_p = padded.clone()
    _Rows(SimpleNamespace(convs={"conv": want_s}), slots, ~keep, lengths).carry_with_torch_ops("conv", want_p, rate)
    got_p, got_s = padded.clone(), state.clone()
    if time_major:
        assert got_p.stride(1) == 1
    state_carry.carry(got_p, got_s, slots, keep, lengths, rate)
    scratch = slots_total  # padding rows race on it; nothing reads it as state
    same = lambda a, b: bool(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan()))  # noqa: E731
    return {"padded_equal": same(got_p, want_p), "state_equal": same(got_s[:scratch], want_s[:scratch]),
            "fresh_row_finite": bool(torch.isfinite(got_p[2]).all()),
            "state_changed": not same(got_s[:scratch], state[:scratch])}


def main() -> None:
    out = {}
    for n, channels, rate, time_major in [(1, 96, 4, True), (6, 96, 1, True), (18, 70, 4, True), (54, 130, 4, True),
                                          (54, 96, 1, False), (6, 64, 4, False)]:
        for dtype in (torch.float32, torch.float16):
            out[f"n{n} C{channels} rate{rate} {'time' if time_major else 'channel'}-major {dtype}"] = case(
                n, channels, rate, time_major, dtype)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
