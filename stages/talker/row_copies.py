"""RowCopies: the runner's copies of requests' small per-row state between rows (moves) and into and out of park
slots (live text), each a few kernels for any number of requests.

A request's small state is a slice of each of the runner's ~20 row tensors (position, frame index, hidden state,
codebook-0 token, repetition mask, sampling parameters, block-table row); its KV never moves (stages/talker/paged_kv.py).
- `move`: requests continue in other rows (a release or park fills its hole with the last row). Each row moves at
  most once and no destination is also a source, so one gather and one scatter per row tensor do all moves at once
  (per-request indexing was a fifth of a served c=256's engine thread), plus each request's first text rows.
- `park` / `unpark` (docs/talker_engine.md, "Live text"): a live request that runs out of text leaves the rows and
  comes back at the end of them when its text arrives. Copied per request and tensor, a wave of text that reaches
  every live request at once (an LLM writing to many connections) cost one kernel per request and tensor, all
  launched from the engine thread: ~2,500 launches for 128 connections, every word. A step's parks are one gather
  and one scatter per tensor; unparks, which come one text at a time while the engine drains its commands, are
  queued and copied together by `flush`, which the runner calls before any other row operation and every step.
Indices cross in one staged copy per call (a ring of 16 host buffers: a buffer is rewritten only once its copy is
done, and one iteration may make several calls, e.g. a release per abort). No host sync.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from stages.talker.staging import IntStage


class RowCopies:
    """Moves, parks and unparks over the runner's row tensors (`row_tensors()`, dim 0 = row), in call order."""

    def __init__(self, num_slots: int, device: torch.device, row_tensors: Callable[[], list[torch.Tensor]]):
        self.num_slots, self._row_tensors = num_slots, row_tensors
        self._slots: list[torch.Tensor] | None = None  # park slots per row tensor, [num_slots, ...] (first park)
        self._stage = IntStage(device, turns=16)
        self._unparks: list[tuple[int, int]] = []  # (slot, row) queued, not yet copied

    def move(self, trailing: torch.Tensor, moves: list[tuple[int, int, int]]) -> None:
        """Each (src, dst, trailing_len): the row's state and its first trailing_len rows of `trailing` (text rows,
        by (row, position) pairs: each request's own length) go to row dst."""
        self.flush()
        if not moves:
            return
        n = len(moves)
        moved = np.array(moves, dtype=np.int64).reshape(n, 3)
        lengths = moved[:, 2]
        k = int(lengths.sum())
        host = self._stage.host(2 * n + 3 * k)
        host[:n], host[n:2 * n] = moved[:, 0], moved[:, 1]
        if k:
            starts = np.cumsum(lengths) - lengths
            host[2 * n:2 * n + k] = np.repeat(moved[:, 0], lengths)  # source row of each text row
            host[2 * n + k:2 * n + 2 * k] = np.repeat(moved[:, 1], lengths)  # its destination row
            host[2 * n + 2 * k:] = np.arange(k) - np.repeat(starts, lengths)  # its position in both
        index = self._stage.copy(2 * n + 3 * k)
        src, dst = index[:n], index[n:2 * n]
        for t in self._row_tensors():
            t[dst] = t[src]
        if k:
            text_src, text_dst, position = index[2 * n:2 * n + k], index[2 * n + k:2 * n + 2 * k], index[2 * n + 2 * k:]
            trailing[text_dst, position] = trailing[text_src, position]

    def park(self, rows: list[int], slots: list[int]) -> None:
        """The state of `rows` goes to park slots `slots` (distinct), after any queued unpark (a request unparked
        and starved again within one iteration parks what it was given back)."""
        self.flush()
        if not rows:
            return
        tensors = self._row_tensors()
        if self._slots is None:
            self._slots = [torch.empty_like(t[:self.num_slots]) for t in tensors]
        src, dst = self._pairs(rows, slots)
        for t, p in zip(tensors, self._slots, strict=True):
            p[dst] = t[src]

    def unpark(self, slot: int, row: int) -> None:
        """The request parked in `slot` continues in the free row `row`: copied at the next `flush`."""
        assert self._slots is not None, "nothing was parked"
        self._unparks.append((slot, row))

    def flush(self) -> None:
        """Copy every queued unpark into its row."""
        if not self._unparks:
            return
        slots, rows = zip(*self._unparks, strict=True)
        self._unparks.clear()
        src, dst = self._pairs(list(slots), list(rows))
        for t, p in zip(self._row_tensors(), self._slots, strict=True):
            t[dst] = p[src]

    def _pairs(self, src: list[int], dst: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(src)
        host = self._stage.host(2 * n)
        host[:n], host[n:] = src, dst
        index = self._stage.copy(2 * n)
        return index[:n], index[n:]
