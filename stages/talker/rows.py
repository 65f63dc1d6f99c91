"""The row lifecycle of the talker engine: what the scheduler decides about rows, done by the runner, then told
to the streams.

Running requests occupy the dense rows [0, n) of every decode step. When requests leave them (finished, aborted,
parked for text), the scheduler names the row moves that keep them dense, the runner copies the movers' small
per-row state in one batch, and the rows left over point at the scratch KV block again. Streams end only after
their rows are free, so a consumer that sees its end and then reads the engine's stats sees the row free.
"""

from __future__ import annotations

from stages.contract import FinishReason
from stages.talker.scheduler import RowMove, Scheduler, Sequence
from stages.talker.stream import ChunkStream


class Rows:
    """Rows, tickets and the pending text rows of the requests that hold them (engine thread only)."""

    def __init__(self, scheduler: Scheduler, runner, num_slots: int):
        self.scheduler, self.runner = scheduler, runner
        self.by_ticket: list[Sequence | None] = [None] * num_slots
        # live requests whose new text rows are not on the device yet (written once per iteration, while they
        # have a row): keyed by identity, as the scheduler's queues are
        self.pending_text: dict[int, Sequence] = {}

    def started(self, seq: Sequence) -> None:
        self.by_ticket[seq.ticket] = seq

    def release(self, finished: list[tuple[Sequence, FinishReason | BaseException]]) -> None:
        """Free the rows (moving the last rows into the holes) and KV blocks, then end the streams."""
        if not finished:
            return
        sched = self.scheduler
        before = sched.num_running
        for seq, _ in finished:
            if seq.ticket >= 0:
                self.by_ticket[seq.ticket] = None
            self.pending_text.pop(id(seq), None)
        self.move(sched.release([s for s, _ in finished]), before)
        for seq, outcome in finished:
            end(seq, outcome)

    def park(self, seqs: list[Sequence], restart: bool = False) -> None:
        """Requests leave their rows and keep ticket and KV (live text: waiting for text, or between segments)."""
        before = self.scheduler.num_running
        self.move(self.scheduler.park(seqs, restart=restart), before)

    def move(self, moves: list[RowMove], before: int) -> None:
        """The scheduler's row moves, done by the runner in one batch; rows [running, before) are free after."""
        running = self.scheduler.running
        self.runner.move_rows([(m.src, m.dst, running[m.dst].trailing_len) for m in moves])
        self.runner.free_rows(self.scheduler.num_running, before)


def end(seq: Sequence, outcome: FinishReason | BaseException) -> None:
    """The end of a request's stream (its last chunk, if any, was delivered before)."""
    ChunkStream.deliver_many([(seq.output.stream, [ChunkStream.end(outcome)])])
