"""One decode step's output, turned into what happened: chunks to hand out, requests finished, live segments ended.

`StepOutputs.take_frame` (a step's frame, read once the code predictor's half is done) and `finish_step` (the whole
step) are the engine's hot bookkeeping, vectorized over the step's rows: Python touches a request only when it
completes a chunk or finishes. It returns its results and calls back into nothing; the engine then
hands the chunks out, releases the finished rows and moves live requests to their next segment.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from stages.chunking import StreamChunker
from stages.contract import NUM_CODEBOOKS, CodecChunk, FinishReason
from stages.talker.rows import Rows
from stages.talker.scheduler import Scheduler, Sequence
from stages.talker.stats import EngineCounters
from stages.talker.stream import ChunkStream


@dataclass
class RequestOutput:
    """Where a running request's frames go: its stream and the chunker cutting them."""

    stream: ChunkStream
    chunker: StreamChunker
    pushed: int = 0  # frames given to the chunker so far


@dataclass
class StepResult:
    deliveries: list[tuple[ChunkStream, list[CodecChunk]]] = field(default_factory=list)
    finished: list[tuple[Sequence, FinishReason | BaseException]] = field(default_factory=list)
    segment_ends: list[Sequence] = field(default_factory=list)  # live text: a flushed segment spoken to its end


@dataclass(frozen=True)
class LaunchedStep:
    """A decode step in flight: its turn on the runner, its rows' tickets and their generations at launch."""

    turn: int
    rows: int
    tickets: np.ndarray
    generations: np.ndarray


class StepOutputs:
    """The frames of every running request (by ticket) and the cutting of them into chunks."""

    def __init__(self, num_slots: int, max_seq_len: int, eos: int, logger):
        self.codes = np.zeros((num_slots, max_seq_len, NUM_CODEBOOKS), dtype=np.int16)
        self.eos, self._logger = eos, logger

    def take_frame(self, codes: np.ndarray, step: LaunchedStep, sched: Scheduler, rows: Rows,
                   counters: EngineCounters) -> StepResult:
        """The step's frame (`codes`: its rows' 16 codes, there before the step is done): stored, and the chunks
        it completes handed out. Whether the request ends with it is known only from the whole step
        (`finish_step`), whose final chunk then holds no frame of this one: the chunks are the same as if both
        halves were read at once, only the frame's come earlier."""
        tickets = step.tickets
        live = sched.live[tickets] & (sched.generation[tickets] == step.generations)
        deliver = live & (codes[:, 0] != self.eos)  # codebook 0 is EOS (sampled at prefill): nothing to hand out
        t_del = tickets[deliver]
        self.codes[t_del, sched.frames[t_del]] = codes[deliver]
        sched.frames[t_del] += 1
        counters.frames += len(t_del)
        result = StepResult()
        for i in np.flatnonzero(deliver & (sched.frames[tickets] >= sched.next_cut[tickets])):
            t = int(tickets[i])
            seq = rows.by_ticket[t]
            try:
                chunks = self._push(seq.output, t, int(sched.frames[t]))
            except ValueError:  # codes the decoder cannot take: `finish_step` fails the request
                continue
            self._hand_out(seq, chunks, sched, counters, result)
        return result

    def finish_step(self, out: np.ndarray, step: LaunchedStep, sched: Scheduler, rows: Rows,
                    counters: EngineCounters) -> StepResult:
        """The rest of a finished step's bookkeeping, after `take_frame` (`out`: its rows' 16 codes and the next
        c0): requests that end (EOS, length), live text's cuts, each stream's next chunk boundary."""
        tickets, eos = step.tickets, self.eos
        live = sched.live[tickets] & (sched.generation[tickets] == step.generations)
        eos_now = out[:, 0] == eos
        frames = sched.frames[tickets]
        ended_eos = live & (eos_now | (out[:, NUM_CODEBOOKS] == eos))
        ended_len = live & ~ended_eos & (frames >= sched.max_frames[tickets])
        starved = live & (frames >= sched.text_limit[tickets])  # live text: no frame until more text arrives
        cut = live & ((frames >= sched.next_cut[tickets]) | starved)
        result = StepResult()
        for i in np.flatnonzero(ended_eos | ended_len | cut):
            t = int(tickets[i])
            seq = rows.by_ticket[t]
            o = seq.output
            try:
                chunks = self._push(o, t, int(frames[i]))
            except ValueError as e:  # codes the decoder cannot take: this request fails, nobody else
                self._logger.error("request %s produced invalid codes: %s", seq.request_id, e)
                result.finished.append((seq, e))
                continue
            if ended_eos[i] and seq.live is not None and seq.live.speaks_on_after_eos():
                chunks.append(o.chunker.cut())  # a flushed segment is spoken to its end; more text may follow
                result.segment_ends.append(seq)
            elif ended_eos[i] or ended_len[i]:
                reason = FinishReason.EOS if ended_eos[i] else FinishReason.LENGTH
                chunks.append(o.chunker.flush(reason))
                result.finished.append((seq, reason))
            else:
                if starved[i]:  # waiting for text: the listener gets every frame so far
                    chunks.append(o.chunker.cut())
                sched.next_cut[t] = frames[i] + o.chunker.frames_to_next_chunk
            self._hand_out(seq, chunks, sched, counters, result)
        return result

    def last_chunks(self, seq: Sequence, sched: Scheduler, outcome: FinishReason | BaseException,
                    counters: EngineCounters) -> StepResult:
        """A running or parked request ends outside a step (live text): its frames so far, then its end."""
        o = seq.output
        chunks = self._push(o, seq.ticket, int(sched.frames[seq.ticket]))
        chunks.append(o.chunker.flush(outcome) if isinstance(outcome, FinishReason) else o.chunker.cut())
        result = StepResult()
        self._hand_out(seq, chunks, sched, counters, result)
        return result

    def _push(self, o: RequestOutput, ticket: int, frames: int) -> list:
        chunks = o.chunker.push(self.codes[ticket, o.pushed:frames]) if frames > o.pushed else []
        o.pushed = frames
        return chunks

    @staticmethod
    def _hand_out(seq: Sequence, chunks: list, sched: Scheduler, counters: EngineCounters,
                  result: StepResult) -> None:
        chunks = [c for c in chunks if c is not None]
        if not chunks:
            return
        result.deliveries.append((seq.output.stream, chunks))
        new_frames = sum(c.num_new for c in chunks)
        if new_frames:
            now = time.monotonic()
            sched.handed_out(seq.ticket, new_frames, now)
            if seq.first_chunk_at is None:
                seq.first_chunk_at = now
                counters.first_chunks += 1
                counters.first_chunk_seconds += now - seq.enqueued_at
                _stamp_first(seq, chunks)


def _stamp_first(seq: Sequence, chunks: list[CodecChunk]) -> None:
    """The stream's first chunk with frames carries when its request was queued (a live request: when its first
    prefill had its text) and prefilled, as wall times: the Server-Timing stages `talker_text` and `talker_queue`."""
    k = next(i for i, c in enumerate(chunks) if c.num_new)
    to_wall = time.time() - time.monotonic()
    stamps = {"queued": seq.enqueued_at + to_wall}
    if seq.admitted_at is not None:
        stamps["prefilled"] = seq.admitted_at + to_wall
    chunks[k] = dataclasses.replace(chunks[k], stamps={**chunks[k].stamps, **stamps})
