"""The talker engine's scheduler: which requests wait, which run in which row, which KV blocks they own.

Torch-free (numpy only), so unit tests drive it without a model. It decides; the runner executes:
- admission is FIFO, by free rows (`max_num_seqs`) and by KV blocks: a request reserves the blocks its
  own length bound needs (prompt + max frames + 2 positions: the last frame's input and one speculative
  step), never a fixed worst case, and the head of the queue waits until that many blocks are free;
- running requests occupy rows [0, n) (what a decode step of batch bucket b computes); a release moves
  the last row into the hole (`RowMove`: the runner copies that request's small per-row state, never KV);
- per-request counters the engine updates every step (frames, limits, next chunk boundary) are numpy
  arrays indexed by a ticket that stays with the request while it runs, so a step's bookkeeping is a few
  vectorized operations and Python touches a request only at chunk boundaries and at its end.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.contract import SynthesisRequest


@dataclass
class Sequence:
    """One request's host-side state, from arrival to release."""

    request: SynthesisRequest
    seed: int
    prompt_len: int
    trailing_len: int
    output: Any  # the engine's per-request output (stream + chunker)
    plan: Any = None  # the prompt as ids (stages/talker/prompt_plan.py), made before it is queued
    ticket: int = -1  # index into the scheduler's per-request arrays while running
    row: int = -1  # batch row (== runner slot) while running
    blocks: np.ndarray | None = None  # KV blocks owned while running
    aborted: bool = False
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def max_positions(self) -> int:
        """KV positions the request can write: prompt, one per frame, one speculative step past its end."""
        return self.prompt_len + self.request.max_frames + 2


@dataclass(frozen=True)
class RowMove:
    src: int
    dst: int


class BlockAllocator:
    """Fixed pool of KV blocks; hands out block ids, takes them back. No block is shared."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = collections.deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def allocate(self, n: int) -> np.ndarray:
        if n > len(self._free):
            raise RuntimeError(f"{n} KV blocks asked, {len(self._free)} free")
        return np.fromiter((self._free.popleft() for _ in range(n)), dtype=np.int64, count=n)

    def release(self, blocks: Iterable[int]) -> None:
        self._free.extend(int(b) for b in blocks)


class Scheduler:
    def __init__(self, max_num_seqs: int, num_blocks: int, block_size: int, max_prefill_batch: int,
                 max_waiting: int):
        self.max_num_seqs, self.max_prefill_batch, self.max_waiting = max_num_seqs, max_prefill_batch, max_waiting
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # by row
        self._by_id: dict[str, Sequence] = {}
        self._tickets = list(range(max_num_seqs))[::-1]  # a stack: low tickets first
        # per ticket, updated by the engine every step
        self.frames = np.zeros(max_num_seqs, dtype=np.int64)  # frames handed out so far
        self.max_frames = np.zeros(max_num_seqs, dtype=np.int64)
        self.next_cut = np.zeros(max_num_seqs, dtype=np.int64)  # frames count at which the next chunk is due
        self.generation = np.zeros(max_num_seqs, dtype=np.int64)  # bumped when a ticket changes hands
        self.live = np.zeros(max_num_seqs, dtype=bool)  # running and neither finished nor aborted
        self._gen = itertools.count(1)

    # ------------------------------------------------------------------ queue
    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.blocks.blocks_for(seq.max_positions) <= self.blocks.num_blocks

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def abort(self, request_id: str) -> Sequence | None:
        """Mark a request aborted and return it (None if unknown or already gone).

        A waiting one leaves the queue at once: it never costs a prefill or a row. A running one stops
        being live; the caller releases it (`release`).
        """
        seq = self._by_id.get(request_id)
        if seq is None or seq.aborted:
            return None
        seq.aborted = True
        if seq.row < 0:
            self.waiting.remove(seq)
            del self._by_id[request_id]
        else:
            self.live[seq.ticket] = False
        return seq

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def reserved_positions(self) -> int:
        """KV positions reserved by running requests (whole blocks)."""
        return (self.blocks.num_blocks - self.blocks.free) * self.blocks.block_size

    # ------------------------------------------------------------------ admission
    def admit(self) -> list[Sequence]:
        """Pop waiting requests that fit (FIFO), give each a row, a ticket and its KV blocks."""
        admitted: list[Sequence] = []
        while (self.waiting and len(self.running) < self.max_num_seqs
               and len(admitted) < self.max_prefill_batch):
            seq = self.waiting[0]
            need = self.blocks.blocks_for(seq.max_positions)
            if need > self.blocks.free:
                break  # FIFO: the head waits for blocks rather than being overtaken forever
            self.waiting.popleft()
            seq.blocks = self.blocks.allocate(need)
            seq.ticket = self._tickets.pop()
            seq.row = len(self.running)
            self.running.append(seq)
            t = seq.ticket
            self.frames[t] = 0
            self.max_frames[t] = seq.request.max_frames
            self.generation[t] = next(self._gen)
            self.live[t] = True
            admitted.append(seq)
        return admitted

    # ------------------------------------------------------------------ release
    def release(self, seqs: Iterable[Sequence]) -> list[RowMove]:
        """Free rows, tickets and blocks of finished/aborted requests; running rows stay dense in [0, n).

        Survivors above the new end fill the holes below it, each moving at most once (`RowMove`).
        """
        gone = {id(s) for s in seqs if s.row >= 0}
        if not gone:
            return []
        keep = len(self.running) - len(gone)
        holes = [r for r in range(keep) if id(self.running[r]) in gone]
        movers = [r for r in range(keep, len(self.running)) if id(self.running[r]) not in gone]
        leaving = [s for s in self.running if id(s) in gone]
        moves = [RowMove(src, dst) for dst, src in zip(holes, movers, strict=True)]
        for move in moves:
            self.running[move.dst] = self.running[move.src]
            self.running[move.dst].row = move.dst
        del self.running[keep:]
        for seq in leaving:
            self.blocks.release(seq.blocks)
            self.live[seq.ticket] = False
            self.generation[seq.ticket] = 0
            self._tickets.append(seq.ticket)
            self._by_id.pop(seq.request_id, None)
            seq.row, seq.ticket, seq.blocks = -1, -1, None
        return moves

    def drop_all(self) -> list[Sequence]:
        """Every waiting and running request, removed (engine failure or shutdown)."""
        gone = [*self.running, *self.waiting]
        self.release(list(self.running))
        self.waiting.clear()
        self._by_id.clear()
        return gone
