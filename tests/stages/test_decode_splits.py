"""`decode_splits` (stages/talker/paged_attention.py): how many programs share a row's keys with
`attention_splits`. The kernel's math with splits is checked under Triton's interpreter
(test_heads_in_attention.py) and on CUDA (test_talker_engine_gpu.py)."""

from __future__ import annotations

import pytest

from stages.talker.paged_attention import decode_splits


@pytest.mark.parametrize("rows,n_kv,expected", [
    (1, 8, 16),  # the 1.7B talker at batch 1: 8 programs -> 128
    (2, 8, 8), (4, 8, 4), (8, 8, 2),
    (16, 8, 1), (256, 8, 1),  # 128 programs or more already: no split, no merge kernel
    (1, 2, 16), (3, 8, 8),  # capped at 16; rows that are not a power of two round up
])
def test_splits_fill_about_one_program_per_sm(rows, n_kv, expected):
    splits = decode_splits(rows, n_kv)
    assert splits == expected
    assert splits & (splits - 1) == 0  # a power of two: the merge kernel's tl.arange over splits needs it


def test_a_split_count_that_is_not_a_power_of_two_is_refused():
    torch = pytest.importorskip("torch")
    from stages.talker.paged_attention import paged_decode_attention

    q = torch.zeros(1, 2, 8)
    with pytest.raises(AssertionError):
        paged_decode_attention(q, torch.zeros(4, 1, 8), torch.zeros(4, 1, 8), torch.zeros(1, 1, dtype=torch.long),
                               torch.ones(1, dtype=torch.long), 4, splits=3)
