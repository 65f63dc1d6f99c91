"""RowCopies (stages/talker/row_copies.py) alone, on CPU tensors: batched parks, queued unparks, moves in call order."""

from __future__ import annotations

import torch

from stages.talker.row_copies import RowCopies


def _rows(n: int = 6) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Row tensors of different shapes and dtypes, each row's values telling the row apart; trailing text rows."""
    pos = torch.arange(n) * 10
    hidden = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4)
    seen = torch.zeros(n, 3, dtype=torch.bool)
    seen[torch.arange(n), torch.arange(n) % 3] = True
    return [pos, hidden, seen], torch.arange(n * 5, dtype=torch.float32).reshape(n, 5)


def test_parks_and_unparks_restore_each_request_in_its_new_row():
    tensors, _ = _rows()
    before = [t.clone() for t in tensors]
    copies = RowCopies(num_slots=6, device=torch.device("cpu"), row_tensors=lambda: tensors)
    copies.park(rows=[1, 4, 2], slots=[5, 0, 3])  # several rows in one call
    for t in tensors:
        t[[1, 2, 4]] = 0  # the rows are reused meanwhile
    copies.unpark(slot=0, row=2)  # row 4's state -> row 2
    copies.unpark(slot=5, row=1)
    assert torch.equal(tensors[0][2], torch.tensor(0))  # queued: nothing copied before a flush
    copies.flush()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[2], b[4]) and torch.equal(t[1], b[1])
    copies.unpark(slot=3, row=4)
    copies.flush()
    copies.flush()  # nothing queued: a no-op
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[4], b[2])


def test_a_move_or_park_applies_the_unparks_queued_before_it():
    tensors, trailing = _rows()
    before = [t.clone() for t in tensors]
    copies = RowCopies(num_slots=6, device=torch.device("cpu"), row_tensors=lambda: tensors)
    copies.park(rows=[3], slots=[1])
    copies.unpark(slot=1, row=5)  # row 3's request resumes at row 5 ...
    copies.move(trailing, [(5, 0, 2)])  # ... and at once moves to row 0 with its first 2 text rows
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[0], b[3])
    assert torch.equal(trailing[0, :2], torch.tensor([25.0, 26.0])) and trailing[0, 2] == 2.0
    copies.unpark(slot=1, row=4)
    copies.park(rows=[4], slots=[2])  # unparked and starved again: it parks what it was given back
    copies.unpark(slot=2, row=1)
    copies.flush()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[1], b[3])
