"""Live text in the talker engine: requests whose text arrives while they run (docs/talker_engine.md, "Live text").

Two halves:
- `LiveTextInput` (event-loop side): each open request's `TextStream`, which turns the text pieces a client sends
  into the token ids later text cannot change;
- `LiveTextDriver` (engine thread): the state machine of a live request. Opened without text it is held (no slot,
  no KV); once its first word is final it is queued and prefilled; when its next text position has not arrived
  it is parked off the rows (keeping slot and KV) and resumes at the end of the rows when the text comes; a
  flushed segment spoken to its end parks it between segments, and the next segment starts with a new prefill in
  the same slot; without text for its idle timeout it ends with `TextTimeoutError`. Only text that completes a
  token (or flushes, or ends) resets the idle timeout: a client trickling the letters of one word never gives the
  engine a position to speak, so it cannot keep a slot that way.

Parked requests keep a slot and KV while they wait, so a client sending a character now and then could hold
every row. Two bounds: a waiting non-live request that cannot get a slot or KV ends the longest-parked live
requests that have waited for text at least `evict_parked_s` (`evict_for_waiting`), and a live request still
waiting for text `max_lifetime_s` after it opened ends (`expire`); both with `LiveTextEvictedError`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from stages.config import ModelConfig
from stages.contract import FinishReason, InvalidRequestError, LiveTextEvictedError, SynthesisRequest, TextTimeoutError
from stages.talker.layout import prefill_length
from stages.talker.live_text import LiveText
from stages.talker.output import StepOutputs
from stages.talker.prompt_plan import plan_prompt
from stages.talker.rows import Rows, end
from stages.talker.scheduler import Scheduler, Sequence
from stages.talker.stats import EngineCounters
from stages.talker.stream import ChunkStream
from stages.text_stream import TextPiece, TextStream

logger = logging.getLogger(__name__)


def live_sequence(request: SynthesisRequest, model_config: ModelConfig, idle_limit_s: float,
                  idle_timeout_s: float | None) -> Sequence:
    """A live request's host state (`TalkerEngine.open_request`): its text comes later, so its prompt has none."""
    prompt = request.prompt
    if prompt.non_streaming_text:
        raise InvalidRequestError("live text needs the streaming-text layout (non_streaming_text=False)")
    if prompt.text_ids:
        raise InvalidRequestError("a live request's text comes through append_text, not its prompt")
    if idle_timeout_s is not None and not 0 < idle_timeout_s:
        raise InvalidRequestError("the text idle timeout must be > 0")
    live = LiveText(prompt, model_config.text_ids.tts_eos, time.monotonic(), min(idle_timeout_s or idle_limit_s,
                                                                                 idle_limit_s))
    # the prefill's length does not depend on the text in this layout: one placeholder id sizes it
    return Sequence(request, 0, prefill_length(replace(prompt, text_ids=(0,))), 0, output=None, live=live)


class LiveTextInput:
    """The open live requests' text tokenizers (event-loop side)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[str, TextStream] = {}

    def open(self, request_id: str) -> None:
        if request_id in self._texts:
            raise InvalidRequestError(f"request {request_id!r} is already open")
        self._texts[request_id] = TextStream(self._tokenizer)

    def append(self, request_id: str, text: str) -> TextPiece | None:
        """Ids later text cannot change (the last word waits for the next one, or for `flush`/`end`)."""
        return self._stream(request_id).append(text)

    def flush(self, request_id: str) -> TextPiece | None:
        return self._stream(request_id).flush()

    def end(self, request_id: str) -> TextPiece | None:
        piece = self._stream(request_id).end()
        del self._texts[request_id]
        return piece

    def forget(self, request_id: str) -> None:
        self._texts.pop(request_id, None)  # the stream ended (consumer's loop): appends now raise

    def _stream(self, request_id: str) -> TextStream:
        stream = self._texts.get(request_id)
        if stream is None:
            raise InvalidRequestError(f"request {request_id!r} is not open for text (unknown, ended or finished)")
        return stream


class LiveTextDriver:
    """Live requests' states on the engine thread, over the scheduler, the rows and the runner."""

    def __init__(self, model_config: ModelConfig, max_text_rows: int, scheduler: Scheduler, runner, rows: Rows,
                 outputs: StepOutputs, counters: EngineCounters, evict_parked_s: float = 1.0,
                 max_lifetime_s: float = 600.0):
        self.model_config, self.max_text_rows = model_config, max_text_rows
        self.evict_parked_s, self.max_lifetime_s = evict_parked_s, max_lifetime_s
        self.scheduler, self.runner, self.rows = scheduler, runner, rows
        self.outputs, self.counters = outputs, counters
        self.expiry_at = float("inf")  # next time a request waiting for text may time out
        self.progress_at: float | None = None  # when this driver last moved a request (the engine's heartbeat)

    def on_text(self, request_id: str, piece: TextPiece | None) -> None:
        """Text for a live request: it may become prefillable, resume where it waited, or finish."""
        sched = self.scheduler
        seq = sched.get(request_id)
        if seq is None or seq.live is None or seq.aborted:
            return  # finished meanwhile (EOS, length, timeout): its text is not needed any more
        live = seq.live
        if piece is None:
            return  # no token complete yet (a word still growing): no progress, the idle time runs on
        live.last_text_at = time.monotonic()
        live.add(piece)
        if live.longest_trailing() > self.max_text_rows:
            self.finish(seq, InvalidRequestError(
                f"input text too long (more than {self.max_text_rows} text positions in one utterance)"))
            return
        if seq.ticket >= 0:
            sched.text_limit[seq.ticket] = live.text_limit()
            self.rows.pending_text[id(seq)] = seq
        if request_id in sched.held:
            if live.can_prefill():
                self.prepare_prefill(seq)
                sched.enqueue(seq)
            elif live.finished:  # ended without a word
                self.finish(seq, InvalidRequestError("input text is empty"))
        elif seq.restart and seq not in sched.restarts:  # between segments
            if live.can_prefill():
                self.prepare_prefill(seq)
                sched.requeue(seq)
            elif live.finished:
                self.finish(seq, FinishReason.EOS)
        elif (request_id in sched.parked and not seq.restart
              and sched.launched_steps[seq.ticket] < live.text_limit()):
            self._unpark(seq)

    def prepare_prefill(self, seq: Sequence) -> None:
        """The plan of the current segment's prefill; its trailing rows come through `write_text`."""
        live = seq.live
        seq.prompt = live.prefill_prompt()
        plan = plan_prompt(self.model_config, seq.prompt)
        seq.plan = replace(plan, trailing_ids=plan.trailing_ids[:0])
        seq.trailing_len = 0
        # each segment draws its own random stream (the counter restarts at frame 0 with every prefill)
        seq.seed = (live.seed + live.first_segment * 0x9E3779B1) & 0x7FFFFFFF
        live.waiting_since = None

    def prefilled(self, seq: Sequence) -> None:
        """A live request's segment was prefilled: its text rows follow in this iteration's text write."""
        seq.live.written = 0
        self.scheduler.text_limit[seq.ticket] = seq.live.text_limit()
        self.rows.pending_text[id(seq)] = seq

    def park_starved(self, tickets: np.ndarray) -> np.ndarray:
        """Running requests whose next step needs text not there yet leave the rows (state saved by ticket, KV
        kept); the last rows fill their holes. Returns the tickets still running, by row."""
        sched = self.scheduler
        starved = sched.launched_steps[tickets] >= sched.text_limit[tickets]
        if not starved.any():
            return tickets
        seqs = [sched.running[r] for r in np.flatnonzero(starved)]
        # saved before any row moves into theirs (device order: after the step in flight)
        self.runner.park_rows([seq.row for seq in seqs], [seq.ticket for seq in seqs])
        self.rows.park(seqs)
        for seq in seqs:
            self.wait_for_text(seq)
        self.counters.parks += len(seqs)
        self.progress_at = time.monotonic()
        return sched.running_tickets()

    def _unpark(self, seq: Sequence) -> None:
        """A parked request has its next text: it continues at the end of the rows, where it stopped."""
        sched = self.scheduler
        row = sched.unpark(seq)
        self.runner.unpark_row(seq.ticket, row)
        live = seq.live
        live.written = int(sched.launched_steps[seq.ticket]) - live.frame_base  # its next text row is the first
        seq.trailing_len = live.written
        live.waiting_since = None
        self.rows.pending_text[id(seq)] = seq
        self.counters.unparks += 1
        self.progress_at = time.monotonic()

    def write_text(self) -> None:
        """New trailing text rows of running live requests, all in one staged write."""
        pending = self.rows.pending_text
        if not pending:
            return
        writes = []
        for key, seq in list(pending.items()):
            if seq.row < 0:
                continue  # parked: written once it has a row again
            start, ids = seq.live.take_trailing()
            if ids:
                writes.append((seq.row, start, np.asarray(ids, dtype=np.int64)))
            seq.trailing_len = seq.live.written
            del pending[key]
        if writes:
            self.runner.write_text(writes)

    def next_segment(self, seq: Sequence) -> None:
        """A flushed segment was spoken to its end (codec EOS): the request leaves its row, keeps its slot and
        KV, and prefills its next segment when that has text (or finishes if the text has ended)."""
        sched = self.scheduler
        self.rows.park([seq], restart=True)
        seq.restart = True  # also when it was parked already (waiting for text when its EOS was read)
        sched.new_generation(seq.ticket)  # the step launched after its EOS is dropped
        live = seq.live
        live.next_segment(int(sched.frames[seq.ticket]))
        sched.text_limit[seq.ticket] = live.text_limit()
        self.rows.pending_text.pop(id(seq), None)
        if live.can_prefill():
            self.prepare_prefill(seq)
            sched.requeue(seq)
        elif live.finished:
            self.finish(seq, FinishReason.EOS)
        else:
            self.wait_for_text(seq)

    def wait_for_text(self, seq: Sequence) -> None:
        now = time.monotonic()
        seq.live.waiting_since = now
        self.expiry_at = min(self.expiry_at, now + seq.live.idle_timeout_s,
                             seq.live.opened_at + self.max_lifetime_s)

    def evict_for_waiting(self) -> int:
        """The head of the queue is a non-live request without a slot or KV: the longest-parked live requests
        that have waited for text at least `evict_parked_s` end (`LiveTextEvictedError`) until it fits or none is
        left. Returns how many ended."""
        sched = self.scheduler
        if not sched.parked or not sched.waiting or sched.waiting[0].live is not None:
            return 0
        now, evicted = time.monotonic(), 0
        while sched.head_blocked():
            parked = [s for s in sched.parked.values()
                      if s.live is not None and s.live.waiting_since is not None
                      and now - s.live.waiting_since >= self.evict_parked_s]
            if not parked:
                break
            seq = min(parked, key=lambda s: s.live.waiting_since)
            self.finish(seq, LiveTextEvictedError(
                f"request {seq.request_id!r} waited {now - seq.live.waiting_since:.1f} s for text while other "
                "requests waited for its slot: it ended to free it"))
            evicted += 1
        if evicted:
            self.counters.live_evictions += evicted
            self.progress_at = now
        return evicted

    def expire(self) -> None:
        """Requests that waited for text longer than their idle timeout end with `TextTimeoutError`, past their
        lifetime with `LiveTextEvictedError`; parked ones give way to waiting work (`evict_for_waiting`)."""
        self.evict_for_waiting()
        now = time.monotonic()
        if now < self.expiry_at:
            return
        sched = self.scheduler
        self.expiry_at = float("inf")
        expired = []
        for seq in [*sched.held.values(), *sched.parked.values()]:
            live = seq.live
            if live is None or live.waiting_since is None:
                continue
            deadline = max(live.waiting_since, live.last_text_at) + live.idle_timeout_s
            end_of_life = live.opened_at + self.max_lifetime_s
            if min(deadline, end_of_life) <= now:
                expired.append(seq)
            else:
                self.expiry_at = min(self.expiry_at, deadline, end_of_life)
        for seq in expired:
            live = seq.live
            if live.opened_at + self.max_lifetime_s <= now:
                self.counters.live_evictions += 1
                self.finish(seq, LiveTextEvictedError(
                    f"request {seq.request_id!r} reached the live-text lifetime of {self.max_lifetime_s:g} s"))
            else:
                self.finish(seq, TextTimeoutError(
                    f"no text for {live.idle_timeout_s:g} s: request {seq.request_id!r} ended"))
        if expired:
            self.progress_at = now

    def finish(self, seq: Sequence, outcome: FinishReason | BaseException) -> None:
        """End a live request in any state: its frames so far are delivered first (an error ends it after them)."""
        sched = self.scheduler
        if seq.ticket >= 0:
            ChunkStream.deliver_many(self.outputs.last_chunks(seq, sched, outcome, self.counters).deliveries)
            sched.live[seq.ticket] = False
            self.rows.release([(seq, outcome)])
        else:
            sched.abort(seq.request_id)  # held or queued: it leaves
            end(seq, outcome)
        self.rows.pending_text.pop(id(seq), None)
