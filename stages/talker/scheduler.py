"""The talker engine's scheduler: which requests wait, which run in which row, which KV blocks they own.

Torch-free (numpy only), so unit tests drive it without a model. It decides; the runner executes:
- admission is FIFO, by free rows (`max_num_seqs`) and by KV blocks: a request reserves the blocks its
  own length bound needs (prompt + max frames + 2 positions: the last frame's input and one speculative
  step), never a fixed worst case, and the head of the queue waits until that many blocks are free;
- running requests occupy rows [0, n) (what a decode step of batch bucket b computes); a release moves
  the last row into the hole (`RowMove`: the runner copies that request's small per-row state, never KV);
- per-request counters the engine updates every step (frames, limits, next chunk boundary, steps launched,
  when the audio handed out so far ends) are numpy arrays indexed by a ticket that stays with the request while
  it runs, so a step's bookkeeping is a few vectorized operations and Python touches a request only at chunk
  boundaries and at its end;
- the admission policy (`admit_for_step`): one prefill batch per iteration, or a burst of several while every
  playing stream has enough audio handed out and not yet played that the extra prefills go unheard;
- priority (`SynthesisRequest.priority`): batch requests wait in a queue of their own and are admitted only
  while no real-time request waits, and only up to `batch_share` of the rows and of the KV blocks, so a
  real-time arrival finds the rest free at once. A running batch request is never preempted: when real-time
  demand rises, it finishes, and the batch requests still waiting wait. A batch stream has no listener, so its
  audio never counts in the admission lead.

Live text (stages/talker/live_text.py) adds two states off the dense rows, so waiting costs the batch nothing:
- held: opened, without the text its prefill needs yet: no slot, no KV, not queued (`hold`, then `enqueue`);
- parked: prefilled, waiting for its next text position: it keeps its ticket (a slot: `max_num_seqs` counts
  running + parked) and its KV blocks, and leaves the rows (`park`: the same hole filling as `release`); it
  comes back at the end of the rows (`unpark`), or, between two segments of its text, through a new prefill
  (`requeue`: such restarts are admitted before the queue, since they hold their slot and KV already).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.contract import FRAME_SECONDS, Priority, SynthesisRequest, TalkerPrompt
from stages.talker.layout import kv_positions
from stages.talker.live_text import UNLIMITED, LiveText


@dataclass(eq=False)  # identity: queues are searched for the very request
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
    admitted_at: float | None = None  # first admission (prefill); a live request's later segments keep it
    first_chunk_at: float | None = None  # when its first chunk with frames was handed to its stream
    live: LiveText | None = None  # text arriving while it runs (None: all text in `request.prompt`)
    prompt: TalkerPrompt | None = None  # what its (next) prefill embeds, when not `request.prompt` (live text)
    restart: bool = False  # parked between two segments: it resumes with a prefill, not where it stopped

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def batch(self) -> bool:
        return self.request.priority is Priority.BATCH

    @property
    def prefill_prompt(self) -> TalkerPrompt:
        return self.prompt if self.prompt is not None else self.request.prompt

    @property
    def max_positions(self) -> int:
        """KV positions the request can write: prompt, one per frame, one speculative step past its end."""
        return kv_positions(self.prompt_len, self.request.max_frames)


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
                 max_waiting: int, batch_share: float = 0.5, max_prefill_tokens: int | None = None,
                 prefill_fits: Callable[[int, int], bool] | None = None):
        self.max_num_seqs, self.max_prefill_batch, self.max_waiting = max_num_seqs, max_prefill_batch, max_waiting
        # prompt positions of one prefill batch at most (None: no bound but its requests), and whether n prompts, the
        # longest of the given positions, make one prefill (the runner's padded bound; None: any that fit the above)
        self.max_prefill_tokens, self.prefill_fits = max_prefill_tokens, prefill_fits
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.waiting: collections.deque[Sequence] = collections.deque()  # real-time requests, FIFO
        self.waiting_batch: collections.deque[Sequence] = collections.deque()  # batch requests, FIFO
        # what batch requests may hold at most (at least one request, or a tiny engine would never run one)
        self.batch_rows = max(1, int(max_num_seqs * batch_share))
        self.batch_blocks = max(1, int(num_blocks * batch_share))
        self._batch_running: dict[int, int] = {}  # ticket of a running batch request -> its KV blocks
        self.running: list[Sequence] = []  # by row
        self.held: dict[str, Sequence] = {}  # live text: opened, not prefillable yet (no slot, no KV)
        self.parked: dict[str, Sequence] = {}  # live text: waiting for text with a ticket and KV, no row
        self.restarts: collections.deque[Sequence] = collections.deque()  # parked, next segment ready to prefill
        self._by_id: dict[str, Sequence] = {}
        self._tickets = list(range(max_num_seqs))[::-1]  # a stack: low tickets first
        # per ticket, updated by the engine every step
        self.frames = np.zeros(max_num_seqs, dtype=np.int64)  # frames handed out so far
        self.max_frames = np.zeros(max_num_seqs, dtype=np.int64)
        self.next_cut = np.zeros(max_num_seqs, dtype=np.int64)  # frames count at which the next chunk is due
        self.generation = np.zeros(max_num_seqs, dtype=np.int64)  # bumped when a ticket changes hands
        self.live = np.zeros(max_num_seqs, dtype=bool)  # running and neither finished nor aborted
        self.text_limit = np.full(max_num_seqs, UNLIMITED, dtype=np.int64)  # steps launchable before text runs out
        self.launched_steps = np.zeros(max_num_seqs, dtype=np.int64)  # frames whose step has been launched
        self.launched_pos = np.zeros(max_num_seqs, dtype=np.int64)  # KV position the next launched step writes
        # when the audio handed out so far ends if its listener plays it from the first chunk on without a pause
        # (after a pause playback resumes with the next chunk); inf: no chunk yet, not playing
        self.play_end = np.full(max_num_seqs, np.inf)
        self.listened = np.zeros(max_num_seqs, dtype=bool)  # real-time: a listener plays the audio (play_end counts)
        self._gen = itertools.count(1)

    # ------------------------------------------------------------------ queue
    def can_ever_fit(self, seq: Sequence) -> bool:
        return self.blocks.blocks_for(seq.max_positions) <= self.blocks.num_blocks

    def add(self, seq: Sequence) -> None:
        self._queue_of(seq).append(seq)
        self._by_id[seq.request_id] = seq

    def _queue_of(self, seq: Sequence) -> collections.deque[Sequence]:
        return self.waiting_batch if seq.batch else self.waiting

    def abort(self, request_id: str) -> Sequence | None:
        """Mark a request aborted and return it (None if unknown or already gone).

        A waiting one leaves the queue at once: it never costs a prefill or a row. A running one stops
        being live; the caller releases it (`release`).
        """
        seq = self._by_id.get(request_id)
        if seq is None or seq.aborted:
            return None
        seq.aborted = True
        if seq.ticket < 0:  # queued or held: it leaves now
            if self.held.pop(request_id, None) is None:
                self._queue_of(seq).remove(seq)
            del self._by_id[request_id]
        else:  # running or parked: released by the caller
            self.live[seq.ticket] = False
        return seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests queued, real-time and batch."""
        return len(self.waiting) + len(self.waiting_batch)

    @property
    def num_waiting_batch(self) -> int:
        return len(self.waiting_batch)

    @property
    def num_running_batch(self) -> int:
        return len(self._batch_running)

    @property
    def has_waiting(self) -> bool:
        return bool(self.waiting or self.waiting_batch)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_parked(self) -> int:
        return len(self.parked)

    @property
    def num_held(self) -> int:
        return len(self.held)

    @property
    def reserved_positions(self) -> int:
        """KV positions reserved by running requests (whole blocks)."""
        return (self.blocks.num_blocks - self.blocks.free) * self.blocks.block_size

    def head_blocked(self) -> bool:
        """The head of the queue cannot be admitted now for want of a slot or of KV blocks."""
        if not self.waiting:
            return False
        if len(self.running) + len(self.parked) >= self.max_num_seqs:
            return True
        return self.blocks.blocks_for(self.waiting[0].max_positions) > self.blocks.free

    # ------------------------------------------------------------------ admission
    def admit(self, limit: int | None = None, tokens: int | None = None, one_prefill: bool = False) -> list[Sequence]:
        """Restarts first (they hold a slot and KV), then waiting real-time requests that fit (FIFO), then, while
        none waits, batch requests within their share; up to `limit` requests and `tokens` prompt positions (default:
        one prefill batch's) in all, the first always: each gets a row, a ticket and its KV blocks. `one_prefill`:
        no more than one prefill holds (`prefill_fits`, the runner's padded bound)."""
        limit = self.max_prefill_batch if limit is None else limit
        budget = self.max_prefill_tokens if tokens is None else tokens
        longest = 0
        admitted: list[Sequence] = []

        def room(queue: collections.deque[Sequence]) -> bool:  # the head's prompt fits what is left
            nonlocal budget, longest
            if len(admitted) >= limit:
                return False
            length = queue[0].prompt_len
            if admitted and budget is not None and length > budget:
                return False
            if admitted and one_prefill and not self._one_prefill(len(admitted) + 1, max(longest, length)):
                return False
            if budget is not None:
                budget -= length
            longest = max(longest, length)
            return True

        while self.restarts and room(self.restarts):
            seq = self.restarts.popleft()
            del self.parked[seq.request_id]
            seq.restart = False
            seq.row = len(self.running)
            self.running.append(seq)
            self.generation[seq.ticket] = next(self._gen)
            admitted.append(seq)
        while self.waiting and self._slot_free():
            need = self.blocks.blocks_for(self.waiting[0].max_positions)
            if need > self.blocks.free or not room(self.waiting):
                break  # FIFO: the head waits for blocks rather than being overtaken forever
            admitted.append(self._start(self.waiting.popleft(), need))
        while not self.waiting and self.waiting_batch and self._slot_free():
            need = self.blocks.blocks_for(self.waiting_batch[0].max_positions)
            held = sum(self._batch_running.values())
            if need > self.blocks.free or len(self._batch_running) >= self.batch_rows or (
                    held and held + need > self.batch_blocks) or not room(self.waiting_batch):
                break  # the rest stays free for real-time arrivals
            admitted.append(self._start(self.waiting_batch.popleft(), need))
        return admitted

    def _slot_free(self) -> bool:
        return len(self.running) + len(self.parked) < self.max_num_seqs

    def _start(self, seq: Sequence, blocks: int) -> Sequence:
        seq.blocks = self.blocks.allocate(blocks)
        seq.ticket = self._tickets.pop()
        seq.row = len(self.running)
        self.running.append(seq)
        t = seq.ticket
        self.frames[t] = 0
        self.max_frames[t] = seq.request.max_frames
        self.text_limit[t] = UNLIMITED
        self.generation[t] = next(self._gen)
        self.live[t] = True
        self.listened[t] = not seq.batch
        if seq.batch:
            self._batch_running[t] = blocks
        return seq

    def admit_for_step(self, lead_s: float, max_prefills: int, now: float) -> list[Sequence]:
        """This iteration's admissions: one prefill (`max_prefill_batch` requests, `max_prefill_tokens` prompt positions,
        within `prefill_fits`), or up to `max_prefills` times that while every playing stream has at least `lead_s`
        of handed-out audio not yet played (each extra prefill delays the next step by its own time). A burst is
        ordered shortest prompt first: one step follows them all, so their order changes no one's first frame,
        and a batch pads to its longest prompt's width."""
        lacks_lead = bool(self.num_running) and self.min_lead_s(now) < lead_s
        batches = 1 if lacks_lead else max_prefills
        tokens = None if self.max_prefill_tokens is None else self.max_prefill_tokens * batches
        admitted = self.admit(limit=self.max_prefill_batch * batches, tokens=tokens, one_prefill=lacks_lead)
        if len(admitted) > 1:
            admitted.sort(key=lambda s: s.prompt_len)
        return admitted

    def _one_prefill(self, n: int, longest: int) -> bool:
        """Whether n prompts, the longest `longest` positions, make one prefill."""
        return self.prefill_fits(n, longest) if self.prefill_fits else n <= self.max_prefill_batch

    def prefill_batches(self, admitted: list[Sequence]) -> list[list[Sequence]]:
        """Admitted requests (shortest prompt first) in prefills that `prefill_fits` (each as large as fits, in order;
        without it, `max_prefill_batch` at a time)."""
        batches: list[list[Sequence]] = []
        batch: list[Sequence] = []
        width = 0  # the batch's longest prompt
        for seq in admitted:
            n, wider = len(batch) + 1, max(width, seq.prompt_len)
            if batch and not self._one_prefill(n, wider):
                batches.append(batch)
                batch, wider = [], seq.prompt_len
            batch.append(seq)
            width = wider
        return batches + [batch] if batch else batches

    def started(self, seq: Sequence, frames_to_next_chunk: int, now: float) -> bool:
        """A request's prefill ran: its per-ticket step counters start; True on its first admission."""
        t = seq.ticket
        first = seq.admitted_at is None
        if first:
            seq.admitted_at = now
            self.play_end[t] = np.inf  # not playing yet
        self.launched_pos[t] = seq.prompt_len
        self.launched_steps[t] = self.frames[t]  # 0, or (a live request's next segment) its frames so far
        self.next_cut[t] = self.frames[t] + frames_to_next_chunk
        return first

    def running_tickets(self) -> np.ndarray:
        """The running requests' tickets, in row order."""
        return np.fromiter((s.ticket for s in self.running), dtype=np.int64, count=len(self.running))

    def min_lead_s(self, now: float) -> float:
        """The least lead among running streams: audio handed out not yet played (inf: none is playing)."""
        return float(self.play_end[self.running_tickets()].min() - now)

    def handed_out(self, ticket: int, new_frames: int, now: float) -> None:
        """`new_frames` of audio were handed to a listener: it plays on from where it is, or from now after a
        pause."""
        if not self.listened[ticket]:
            return  # a batch stream: nobody plays it, it never lacks lead
        end = self.play_end[ticket]
        self.play_end[ticket] = (now if end == np.inf else max(end, now)) + new_frames * FRAME_SECONDS

    def new_generation(self, ticket: int) -> None:
        """Steps launched for `ticket` before now are dropped when read (their rows changed meaning)."""
        self.generation[ticket] = next(self._gen)

    # ------------------------------------------------------------------ live text
    def hold(self, seq: Sequence) -> None:
        """A live request that cannot be prefilled yet (no text): known by id, not queued."""
        self.held[seq.request_id] = seq
        self._by_id[seq.request_id] = seq

    def enqueue(self, seq: Sequence) -> None:
        """A held request has the text its prefill needs: it joins the queue (FIFO)."""
        del self.held[seq.request_id]
        seq.enqueued_at = time.monotonic()
        self._queue_of(seq).append(seq)

    def park(self, seqs: Iterable[Sequence], restart: bool = False) -> list[RowMove]:
        """Running requests leave their rows and keep ticket and KV blocks (rows stay dense, as in `release`).

        `restart`: they resume with a new prefill (next segment) rather than where they stopped.
        """
        seqs = [s for s in seqs if s.row >= 0]
        moves = self._leave_rows(seqs)
        for seq in seqs:
            seq.restart = restart
            self.parked[seq.request_id] = seq
        return moves

    def unpark(self, seq: Sequence) -> int:
        """A parked request continues in the next free row (the end of the dense rows); returns it."""
        del self.parked[seq.request_id]
        seq.row = len(self.running)
        self.running.append(seq)
        return seq.row

    def requeue(self, seq: Sequence) -> None:
        """A request parked between segments can prefill its next one: admitted before the queue."""
        self.restarts.append(seq)

    # ------------------------------------------------------------------ release
    def release(self, seqs: Iterable[Sequence]) -> list[RowMove]:
        """Free rows, tickets and blocks of finished/aborted requests (running or parked); running rows stay
        dense in [0, n): survivors above the new end fill the holes below it, each moving at most once."""
        seqs = list({id(s): s for s in seqs if s.ticket >= 0}.values())
        moves = self._leave_rows([s for s in seqs if s.row >= 0])
        for seq in seqs:
            if self.parked.pop(seq.request_id, None) is not None and seq in self.restarts:
                self.restarts.remove(seq)
            self.blocks.release(seq.blocks)
            self._batch_running.pop(seq.ticket, None)
            self.live[seq.ticket] = False
            self.generation[seq.ticket] = 0
            self._tickets.append(seq.ticket)
            self._by_id.pop(seq.request_id, None)
            seq.ticket, seq.blocks, seq.restart = -1, None, False
        return moves

    def _leave_rows(self, seqs: list[Sequence]) -> list[RowMove]:
        """Take running requests off their rows; the last rows fill the holes (`RowMove`s, each row at most once)."""
        gone = {id(s) for s in seqs}
        if not gone:
            return []
        keep = len(self.running) - len(gone)
        holes = [r for r in range(keep) if id(self.running[r]) in gone]
        movers = [r for r in range(keep, len(self.running)) if id(self.running[r]) not in gone]
        moves = [RowMove(src, dst) for dst, src in zip(holes, movers, strict=True)]
        for move in moves:
            self.running[move.dst] = self.running[move.src]
            self.running[move.dst].row = move.dst
        del self.running[keep:]
        for seq in seqs:
            seq.row = -1
        return moves

    def drop_all(self) -> list[Sequence]:
        """Every waiting and running request, removed (engine failure or shutdown)."""
        gone = [*self.running, *self.parked.values(), *self.waiting, *self.waiting_batch, *self.held.values()]
        self.release([*self.running, *self.parked.values()])
        self.waiting.clear()
        self.waiting_batch.clear()
        self.held.clear()
        self._by_id.clear()
        return gone
