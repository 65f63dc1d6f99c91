"""TalkerEngine: continuous batching of talker requests on one device thread, driven from asyncio.

The engine wires; it decides nothing itself: the torch-free scheduler (scheduler.py) decides who waits, who runs
in which row, which KV blocks they own and how many prefills an iteration takes; the runner (runner.py) alone owns
the device; output.py turns step outputs into chunks; rows.py moves and frees rows; live_requests.py drives live
text; stats.py counts. Requests enter through a thread-safe command queue; codec chunks leave through per-request
`ChunkStream`s, one event-loop callback per step for all streams.

One iteration (docs/talker_engine.md): drain commands -> expire live requests idle too long -> admit (staged, one
copy, prefill graph; nothing waits) -> launch step N+1 -> read step N while N+1 runs: its frame once the code
predictor's half is done (handed out at once), then the whole step (ends). A request that ended by EOS in step N
was computed in N+1 too; that frame is dropped (its KV reservation includes the speculative position).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import ClassVar

from stages import row_invariant_products
from stages.chunking import ChunkSchedule, StreamChunker
from stages.contract import EngineOverloadedError, FinishReason, InvalidRequestError, SynthesisRequest
from stages.qwen3_tts import Qwen3TTS
from stages.talker import cuda_graphs
from stages.talker.compiled import talker_compile_cache
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.live_requests import LiveTextDriver, LiveTextInput, live_sequence
from stages.talker.output import LaunchedStep, RequestOutput, StepOutputs
from stages.talker.paged_kv import kv_pool_blocks
from stages.talker.prefill import build_prefill
from stages.talker.prompt_plan import plan_prompt
from stages.talker.rows import Rows, end
from stages.talker.runner import Admission, TalkerRunner
from stages.talker.scheduler import Scheduler, Sequence
from stages.talker.stats import EngineCounters, EngineStats, snapshot
from stages.talker.stream import ChunkStream
from stages.text_stream import TextPiece

logger = logging.getLogger(__name__)


class TalkerEngine:
    config_cls: ClassVar[type] = TalkerEngineConfig  # what `engine_kwargs` configure (deployments/loading.py)

    def __init__(self, model: Qwen3TTS, config: TalkerEngineConfig | None = None,
                 runner_factory: Callable[..., TalkerRunner] = TalkerRunner):
        """`runner_factory` builds the device side (`TalkerRunner`'s signature); tests pass a fake."""
        config = config or TalkerEngineConfig()
        if model.talker is None:
            raise ValueError("TalkerEngine needs a model loaded with its talker")
        self.invariant_products = config.deterministic and model.device.type == "cuda"
        if self.invariant_products:  # cuBLAS without a workspace, whose rows `_setup` checks
            row_invariant_products.use_no_workspace()
        self.model, self.config = model, config.for_determinism(self.invariant_products)
        self._runner_factory = runner_factory
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake, self._ready = threading.Event(), threading.Event()
        self._stop, self._error = False, None
        self._seed_counter = itertools.count(int(time.time_ns() % (1 << 31)))
        self.counters = EngineCounters()
        # add commands not yet drained (counted as waiting): one counter per writing thread, so no update is lost
        self._adds_sent, self._adds_drained = 0, 0  # counted by the event-loop side and by the engine thread
        self._progress_at, self._idle = time.monotonic(), False  # check_health's heartbeat; idle: no work, none owed
        self.num_slots = 0
        self._thread: threading.Thread | None = None
        self.runner: TalkerRunner | None = None
        self.scheduler: Scheduler | None = None
        self._rows: Rows  # the rest of the device thread's parts, made by _setup
        self._outputs: StepOutputs
        self._live: LiveTextDriver
        self._texts = LiveTextInput(model.tokenizer)
        self.on_admit: Callable[[list[str]], None] | None = None  # test hook: request ids admitted (engine thread)

    # ------------------------------------------------------------------ lifecycle
    def start(self, log: Callable[[str], None] = print, timeout: float | None = None) -> None:
        """Start the device thread: size the KV pool, capture graphs. Blocks until ready."""
        self._thread = threading.Thread(target=self._main, args=(log,), name="talker-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("talker engine did not become ready in time")
        if self._error is not None:
            raise RuntimeError("talker engine failed to start") from self._error

    def shutdown(self) -> None:
        """Stop the loop; every open stream ends with an error (nobody is left waiting forever)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None and not self._stop

    def check_health(self) -> None:
        """Raise if the loop died, or holds work and made no progress for `stall_timeout_s` (stuck device)."""
        if self._error is not None:
            raise RuntimeError(f"talker engine failed: {self._error!r}")
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("talker engine thread is not running")
        stats, waiting_for_work = self.stats(), self._idle  # read before the heartbeat: the loop sets it first
        idle_for = time.monotonic() - self._progress_at
        pending = stats.running or (stats.waiting and not stats.parked)  # parked ones wait for text, not the device
        if pending and not waiting_for_work and idle_for > self.config.stall_timeout_s:
            raise RuntimeError(f"talker engine made no progress for {idle_for:.0f} s with work pending")

    # ------------------------------------------------------------------ API (event-loop side)
    def add_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None) -> ChunkStream:
        """Queue a request; its codec chunks arrive on the returned stream. Call from the asyncio loop."""
        self._check_running()
        plan = plan_prompt(self.model.config, request.prompt)  # host work, here rather than on the engine thread
        seq = Sequence(request, 0, plan.length, plan.trailing_length, output=None, plan=plan)
        if plan.trailing_length > self.config.max_text_rows:
            raise InvalidRequestError(f"input text too long ({len(request.prompt.text_ids)} tokens)")
        self._check_fits(seq)
        stream = self._output(seq, schedule)
        self._adds_sent += 1
        self._commands.put(("add", seq))
        self._wake.set()
        return stream

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError("talker engine has failed") from self._error
        if self._stop:
            raise RuntimeError("talker engine is shut down")

    def _check_fits(self, seq: Sequence) -> None:
        seq.request.sampling.validate()
        if seq.request.max_frames < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1")
        if seq.max_positions > self.config.max_seq_len:
            raise InvalidRequestError(f"request too long: prompt of {seq.prompt_len} positions + {seq.request.max_frames}"
                                      f" frames exceeds the engine's max_seq_len {self.config.max_seq_len}")
        sched = self.scheduler
        if sched is not None and not sched.can_ever_fit(seq):
            raise InvalidRequestError("request needs more KV than the engine has")
        waiting = sched.num_waiting + sched.num_held if sched is not None else 0
        if self._adds_queued + waiting >= self.config.max_waiting:
            raise EngineOverloadedError(f"{self.config.max_waiting} requests already waiting")

    def _output(self, seq: Sequence, schedule: ChunkSchedule | None) -> ChunkStream:
        """The request's seed, stream and chunker."""
        request = seq.request
        seq.seed = (request.seed if request.seed is not None else next(self._seed_counter)) & 0x7FFFFFFF
        stream = ChunkStream(request.request_id, asyncio.get_running_loop(), on_close=self.abort)
        chunker = StreamChunker(schedule or self.config.schedule, request.request_id,
                                ref_codes=request.prompt.ref_codes)
        seq.output = RequestOutput(stream, chunker)
        return stream

    # ------------------------------------------------------------------ live text (event-loop side)
    def open_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None,
                     text: str = "", idle_timeout_s: float | None = None) -> ChunkStream:
        """Open a request whose text arrives while it runs; its chunks arrive on the returned stream.

        `request.prompt` carries everything but the text (`text_ids=()`; `stages.prompts.build_live_prompt`) and
        uses the streaming-text layout. Text then comes through `append_text` (pieces of any size), `flush_text`
        and `end_text`. The request is prefilled once its first word is final, steps while text is ahead of it,
        and waits off the rows (keeping its slot and KV) when it is not; `idle_timeout_s` (at most, and by
        default, the engine's `text_idle_timeout_s`) without text while it waits ends it with `TextTimeoutError`.
        `abort` works as for `add_request`. KV: prompt + `max_frames` + 2 positions like any other request (the
        streaming-text prompt does not depend on the text, which is added to the frames' inputs)."""
        self._check_running()
        seq = live_sequence(request, self.model.config, self.config.text_idle_timeout_s, idle_timeout_s)
        self._check_fits(seq)
        self._texts.open(request.request_id)  # raises if the id is open already
        stream = self._output(seq, schedule)
        seq.live.seed = seq.seed
        stream.on_end = self._texts.forget
        self._adds_sent += 1
        self._commands.put(("open", seq))
        self._wake.set()
        if text:
            self.append_text(request.request_id, text)
        return stream

    def append_text(self, request_id: str, text: str) -> None:
        """More text for an open request. Only ids that later text cannot change are sent to the engine (the
        last word waits for the next one, or for `flush_text`/`end_text`)."""
        self._send_text(request_id, self._texts.append(request_id, text))

    def flush_text(self, request_id: str) -> None:
        """Speak the text so far as if it ended here, without closing: the held-back tail is released and the
        text so far is one utterance, spoken to its end (eos, then pad text rows, until the codec's EOS). Text
        after it is the next utterance, spoken after it on the same stream (a new prefill of the same prompt,
        in the request's slot and KV; `max_frames` counts all of them)."""
        piece = self._texts.flush(request_id)
        if piece is not None:
            self._send_text(request_id, piece)

    def end_text(self, request_id: str) -> None:
        """The text is complete: the request finishes normally (codec EOS or `max_frames`)."""
        self._send_text(request_id, self._texts.end(request_id))

    def _send_text(self, request_id: str, piece: TextPiece | None) -> None:
        # pieces without ids still count as text arriving (the idle timeout), so they are sent too
        self._commands.put(("text", (request_id, piece)))
        self._wake.set()

    def run_on_device(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine's device thread between steps (e.g. voice-clone encoders): one thread owns the
        replica's device work; the caller awaits the future. Short work only: running requests wait for it."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", (fn, future)))
        self._wake.set()
        return future

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step boundary and free its row. Safe from any thread."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    @property
    def _adds_queued(self) -> int:
        return self._adds_sent - self._adds_drained

    def stats(self) -> EngineStats:
        clock = self.runner.step_clock.stats if self.runner is not None else None
        return snapshot(self.counters, self.scheduler, self._adds_queued, self.num_slots, clock)

    def recent_steps(self) -> dict:  # the last steps one by one; apart from `stats`, which the hot path reads
        return self.runner.step_clock.recent_steps() if self.runner is not None else {}

    # ------------------------------------------------------------------ device thread
    def _main(self, log: Callable[[str], None]) -> None:
        try:
            self._setup(log)
        except BaseException as e:  # reported to start()
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:  # a device-level fault: fail every stream loudly rather than hang them
            self._error = e
            logger.exception("talker engine failed")  # check_health reports it; Serve replaces the replica
            self._end_all(e)
            return
        self._end_all(RuntimeError("talker engine shut down"))

    def _setup(self, log: Callable[[str], None]) -> None:
        """Without `kv_cache_tokens`, the CUDA KV pool is sized after a warm-up, before capture (docs/talker_engine.md)."""
        cfg, model = self.config, self.model
        cuda = model.device.type == "cuda"
        self.num_slots = cfg.max_num_seqs
        self._buckets = tuple(sorted({min(b, self.num_slots) for b in cfg.kernels.batch_buckets} | {self.num_slots}))
        if self.invariant_products:  # before any compile or capture: refuse to start rather than drift
            row_invariant_products.check(model.talker, {*self._buckets, *(2 * b for b in self._buckets), *(
                b * w for b in cfg.prefill_batches for w in cfg.prefill_widths)}, model.device, model.dtype)
        compile_cache = talker_compile_cache(model, cfg)
        if cfg.compile and cuda:
            loaded = compile_cache is not None and compile_cache.load(log)
            log("[talker] compiling fused kernels" + (" (from the compile cache)" if loaded else ""))
        pool = partial(kv_pool_blocks, cfg, model.config.talker.transformer, model.device, model.dtype, log)
        sized_after_warm_up = cfg.kv_cache_tokens is None and cuda
        num_blocks = 1 if sized_after_warm_up else pool()
        self.runner = self._runner_factory(model, cfg, num_blocks)
        if sized_after_warm_up:
            log("[talker] warming up before sizing the KV pool")
            cuda_graphs.warm_up(self.runner, self._buckets)
            num_blocks = pool()
            self.runner.resize_kv(num_blocks)
        self.scheduler = Scheduler(self.num_slots, num_blocks, cfg.kernels.kv_block_size, cfg.max_prefill_batch,
                                   cfg.max_waiting, cfg.batch_share, cfg.max_prefill_tokens, self.runner.prefill_fits)
        self._exact = not cuda if cfg.kernels.exact_prefill is None else cfg.kernels.exact_prefill
        self._rows = Rows(self.scheduler, self.runner, self.num_slots)
        self._outputs = StepOutputs(self.num_slots, cfg.max_seq_len, self.runner.eos, logger)
        self._live = LiveTextDriver(model.config, cfg.max_text_rows, self.scheduler, self.runner, self._rows,
                                    self._outputs, self.counters, cfg.live_evict_parked_s, cfg.live_max_lifetime_s)
        if cfg.cuda_graphs and cuda:  # it logs its progress and time
            cuda_graphs.capture(self.runner, self._buckets, log)
        if compile_cache is not None:
            compile_cache.save(log)

    def _loop(self) -> None:
        sched = self.scheduler
        pending = None  # the launched step not yet read
        while not self._stop:
            self._drain_commands(block=not (sched.running or sched.has_waiting or sched.restarts or pending))
            if self._stop:
                break
            self._live.expire()
            self._admit()
            launched = self._launch()
            if pending is not None:
                self._process(pending)
            pending = launched
            if self._live.progress_at is not None:  # live requests moved without a step (parks, timeouts)
                self._progress_at = max(self._progress_at, self._live.progress_at)
        if pending is not None:
            self._process(pending)

    def _drain_commands(self, block: bool) -> None:
        if block:  # idle; requests waiting for text may time out meanwhile
            expiry_at = self._live.expiry_at
            timeout = expiry_at - time.monotonic() if expiry_at < float("inf") else None
            self._idle = True  # until the heartbeat restarts: a request queued meanwhile is no stall
            self._wake.wait(None if timeout is None else max(timeout, 0.0))
            self._progress_at, self._idle = time.monotonic(), False
        self._wake.clear()
        sched = self.scheduler
        for kind, payload in self._queued_commands():
            if self._take_new_request(kind, payload):
                if kind == "open":
                    self._live.wait_for_text(payload)
            elif kind == "text":
                try:
                    self._live.on_text(*payload)
                except Exception as e:  # host-side trouble with one request's text: that request fails alone
                    logger.exception("live text of request %s failed", payload[0])
                    seq = sched.get(payload[0])
                    if seq is not None:
                        self._live.finish(seq, e)
            elif kind == "abort":
                seq = sched.abort(payload)
                if seq is not None and seq.ticket < 0:  # was queued or held: it leaves with no prefill and no row
                    end(seq, FinishReason.ABORTED)
                elif seq is not None:  # running: its row frees now (a step in flight still computes it: dropped);
                    self._rows.release([(seq, FinishReason.ABORTED)])  # parked: its slot and KV
            elif kind == "call":
                fn, future = payload
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's error, not the engine's
                        future.set_exception(e)

    def _queued_commands(self):
        """(kind, payload) of every command queued now, in order, without waiting."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _take_new_request(self, kind: str, payload) -> bool:
        """An `add` (queued for admission) or `open` (held until its text) command: taken into the scheduler."""
        if kind == "add":
            self.scheduler.add(payload)
            self.counters.command_wait_seconds += time.monotonic() - payload.enqueued_at
        elif kind == "open":
            self.scheduler.hold(payload)
        else:
            return False
        self._adds_drained += 1
        return True

    def _admit(self) -> None:
        """This iteration's admissions (the scheduler's policy), in prefills the runner holds (`prefill_batches`).
        A failed prefill fails its batch alone: their rows fill from later ones, their streams end with the error."""
        cfg = self.config
        admitted = self.scheduler.admit_for_step(cfg.admission_lead_s, cfg.max_prefills_per_step, time.monotonic())
        failed: list[tuple[Sequence, BaseException]] = []
        prefilled = 0
        for batch in self.scheduler.prefill_batches(admitted):
            error = self._prefill(batch)
            if error is not None:
                failed += [(s, error) for s in batch]
                continue
            self.counters.burst_prefills += prefilled > 0
            prefilled += 1
        self._rows.release(failed)

    def _prefill(self, batch: list[Sequence]) -> BaseException | None:
        """One batched prefill of admitted requests (their rows, tickets and KV blocks are theirs already);
        the error if it failed (the caller releases the batch with it)."""
        sched, runner, counters = self.scheduler, self.runner, self.counters
        t0 = time.perf_counter()
        try:
            runner.admit([
                Admission(s.row, s.plan, s.request.sampling, s.seed, s.blocks,
                          build_prefill(runner.talker, self.model.config, s.prefill_prompt) if self._exact else None)
                for s in batch
            ])
        except Exception as e:  # this batch's requests fail; the engine and everyone else go on
            logger.exception("admission of %d requests failed", len(batch))
            return e
        now = time.monotonic()
        for s in batch:
            if sched.started(s, s.output.chunker.frames_to_next_chunk, now):
                counters.admitted += 1
                counters.admission_wait_seconds += now - s.enqueued_at
            self._rows.started(s)
            if s.live is not None:
                self._live.prefilled(s)
        counters.prefills += 1
        counters.prefill_seconds += time.perf_counter() - t0
        self._progress_at = time.monotonic()
        if self.on_admit is not None:
            self.on_admit([s.request_id for s in batch])
        return None

    def _launch(self) -> LaunchedStep | None:
        """Launch the next step for every running row, unless no row can use it: rows that already have a step
        launched for their last frame (max_frames) need none, and an idle GPU takes the next prefill at once."""
        sched, runner = self.scheduler, self.runner
        if sched.num_running == 0:
            return None
        t0 = time.perf_counter()
        tickets = self._live.park_starved(sched.running_tickets())  # rows whose next text is not there leave first
        self._live.write_text()
        n = len(tickets)
        if n == 0 or not (sched.launched_steps[tickets] < sched.max_frames[tickets]).any():
            return None
        sched.launched_steps[tickets] += 1
        positions = sched.launched_pos[tickets]
        attn_len = runner.attn_bucket(int(positions.max()))
        turn = runner.launch_step(next(x for x in self._buckets if x >= n), attn_len)
        sched.launched_pos[tickets] = positions + 1
        self.counters.step_seconds += time.perf_counter() - t0
        return LaunchedStep(turn, n, tickets, sched.generation[tickets].copy())

    def _process(self, step: LaunchedStep) -> None:
        """Read a step and hand out what it produced: its frame's chunks as soon as the frame's codes are there,
        then, once the step is done, ends (the next frame's codebook 0 is EOS) and live segments that ended."""
        t0 = time.perf_counter()
        codes = self.runner.step_codes(step.turn, step.rows)  # the frame, before the step's talker half is done
        waited = time.perf_counter() - t0
        ChunkStream.deliver_many(self._outputs.take_frame(codes, step, self.scheduler, self._rows,
                                                          self.counters).deliveries)
        t1 = time.perf_counter()
        out = self.runner.step_output(step.turn, step.rows)
        self.counters.step_read(waited + time.perf_counter() - t1, step.rows)
        self._progress_at = time.monotonic()
        result = self._outputs.finish_step(out, step, self.scheduler, self._rows, self.counters)
        ChunkStream.deliver_many(result.deliveries)
        self._rows.release(result.finished)
        for seq in result.segment_ends:
            self._live.next_segment(seq)
        self.counters.step_seconds += time.perf_counter() - t0

    def _end_all(self, error: BaseException) -> None:
        sched = self.scheduler
        if sched is None:
            return
        for kind, payload in self._queued_commands():  # requests still in the command queue end below too
            if not self._take_new_request(kind, payload) and kind == "call":
                payload[1].set_exception(error)
        for seq in sched.drop_all():
            seq.output.stream.fail(error)
