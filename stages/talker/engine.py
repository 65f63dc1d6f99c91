"""TalkerEngine: continuous batching of talker requests on one device thread, driven from asyncio.

A thin loop wiring the scheduler (stages/talker/scheduler.py: who waits, who runs where, KV blocks) to the
runner (stages/talker/runner.py: the only owner of the device). Requests enter through a thread-safe
command queue; codec chunks (with left context, cut by the serving schedule right here, where the frames
are) leave through per-request `ChunkStream`s, one event-loop callback per step for all streams.

One iteration of the loop:
1. drain commands (new requests, aborts: a waiting request that is aborted leaves without a prefill);
2. admit a batch (<= max_prefill_batch): staged on the host, one copy, prefill graph; nothing waits; up to
   max_prefills_per_step batches (shortest prompts first) while every running stream's handed-out audio leads
   its playback enough;
3. launch step N+1 for every running row;
4. read step N's output (the one wait per step, while step N+1 runs) and do its bookkeeping, vectorized
   over the rows; Python touches a request only when it completes a chunk or finishes.
A request that finished by EOS in step N was also computed in step N+1 (launched before N was read); that
frame is dropped, and its KV reservation includes that speculative position. Length limits are known ahead:
no step is launched that no row can use.

Live text (`open_request`, `append_text`, `flush_text`, `end_text`; docs/talker_engine.md, "Live text"): a
request whose next text position has not arrived is parked before step N+1 is launched (off the rows, with
its ticket and KV) and comes back at the end of the rows when its text arrives; appended text reaches the
device rows in one staged copy per iteration.
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
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import torch

from stages.arrival_rate import ArrivalRate
from stages.chunking import ChunkSchedule, StreamChunker
from stages.compile_cache import CompileCache
from stages.contract import (
    FRAME_SECONDS,
    NUM_CODEBOOKS,
    EngineOverloadedError,
    FinishReason,
    InvalidRequestError,
    SynthesisRequest,
    TextTimeoutError,
)
from stages.qwen3_tts import Qwen3TTS
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.layout import prefill_length
from stages.talker.live_text import LiveText
from stages.talker.paged_kv import PagedKVCache
from stages.talker.prefill import build_prefill
from stages.talker.prompt_plan import plan_prompt
from stages.talker.runner import COMPILED_SOURCES, Admission, TalkerRunner
from stages.talker.scheduler import RowMove, Scheduler, Sequence
from stages.talker.step_clock import DeviceClockStats
from stages.talker.stream import ChunkStream
from stages.text_stream import TextPiece, TextStream

logger = logging.getLogger(__name__)

HOST_BOUND_WAIT_S = 2e-4  # a step output read waiting less than this found it ready (EngineStats.host_bound_steps)


@dataclass(frozen=True)
class EngineStats:
    waiting: int  # requests queued (not yet admitted)
    running: int
    max_running: int  # rows (max_num_seqs)
    kv_reserved_tokens: int  # KV positions reserved by running requests (whole blocks)
    kv_total_tokens: int
    steps: int
    frames: int
    prefills: int = 0  # batched prefills run (admissions)
    burst_prefills: int = 0  # of them, launched after another in the same iteration (max_prefills_per_step)
    held_admissions: int = 0  # loop iterations whose admission waited for more arrivals (prefill_hold_s)
    prefill_seconds: float = 0.0  # engine-thread time spent launching them (they never wait for the device)
    step_seconds: float = 0.0  # engine-thread time spent launching steps and reading their output
    device_wait_seconds: float = 0.0  # of step_seconds, blocked until a step's output was ready: the rest is host
    # work (Python, launches, waiting for the GIL); near zero means the device waits for the host instead
    host_bound_steps: int = 0  # steps whose output was ready before the engine thread read it (it had launched
    # the next step already, so the device idled since, unless a prefill or another process kept it busy)
    parked: int = 0  # live text: prefilled requests waiting for text, off the rows (they keep slot and KV)
    held: int = 0  # live text: opened requests without the text their prefill needs (no slot, no KV)
    # from `add_request` (or a live request's first text) inside the engine: sums over requests, so a caller
    # that reads stats twice gets the means of the requests in between (what the engine adds to first audio,
    # against what a client sees: the rest is the serving path)
    admitted: int = 0  # requests admitted (first prefill)
    admission_wait_seconds: float = 0.0  # their time from add to admission
    command_wait_seconds: float = 0.0  # of it, from add until the engine thread took the request (the rest: queued)
    first_chunks: int = 0  # requests whose first chunk with frames was handed to their stream
    first_chunk_seconds: float = 0.0  # their time from add to that hand-over
    # the device's clock around the steps (CUDA; stages/talker/step_clock.py): their own GPU time and the gaps
    # between them (prefills, or the device waiting for the host); all zero without a device clock
    device_clock: DeviceClockStats = field(default_factory=DeviceClockStats)


@dataclass
class _Output:
    """Where a running request's frames go: its stream and the chunker cutting them."""

    stream: ChunkStream
    chunker: StreamChunker
    pushed: int = 0  # frames given to the chunker so far


class TalkerEngine:
    config_cls: ClassVar[type] = TalkerEngineConfig  # what `engine_kwargs` configure (deployments/loading.py)

    def __init__(self, model: Qwen3TTS, config: TalkerEngineConfig | None = None,
                 runner_factory: Callable[..., TalkerRunner] = TalkerRunner):
        """`runner_factory` builds the device side (`TalkerRunner`'s signature); tests pass a fake."""
        config = config or TalkerEngineConfig()
        if model.talker is None:
            raise ValueError("TalkerEngine needs a model loaded with its talker")
        self.model, self.config = model, config
        self._runner_factory = runner_factory
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._seed_counter = itertools.count(int(time.time_ns() % (1 << 31)))
        self._steps = self._frames = self._prefills = self._burst_prefills = self._held_admissions = 0
        self._arrivals = ArrivalRate()  # requests added per second lately (prefill_hold_s)
        self._admitted = self._first_chunks = 0
        self._admission_wait = self._first_chunk_wait = self._command_wait = 0.0
        self._host_bound_steps = 0
        self._prefill_seconds = self._step_seconds = self._device_wait = 0.0
        # add commands not yet drained (counted as waiting): one counter per writing thread, so no update is lost
        self._adds_sent = 0  # event-loop side
        self._adds_drained = 0  # engine thread
        self._progress_at = time.monotonic()  # last step/admission (heartbeat for check_health)
        self.num_slots = 0
        self.graph_capture_seconds = 0.0
        self._thread: threading.Thread | None = None
        self.runner: TalkerRunner | None = None
        self.scheduler: Scheduler | None = None
        self.on_admit: Callable[[list[str]], None] | None = None  # test hook: request ids admitted (engine thread)
        self._texts: dict[str, TextStream] = {}  # live text being tokenized (event-loop side)
        self._text_dirty: dict[int, Sequence] = {}  # live requests with text rows not written yet (engine thread)
        self._expiry_at = float("inf")  # next time a request waiting for text may time out (engine thread)
        self.parks = self.unparks = 0  # live text: requests parked / resumed (counters for tests and stats)

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
        stats = self.stats()
        idle_for = time.monotonic() - self._progress_at
        # parked requests may hold every slot while they wait for text (they time out): no device is stuck then
        pending = stats.running or (stats.waiting and not stats.parked)
        if pending and idle_for > self.config.stall_timeout_s:
            raise RuntimeError(f"talker engine made no progress for {idle_for:.0f} s with work pending")

    # ------------------------------------------------------------------ API (event-loop side)
    def add_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None) -> ChunkStream:
        """Queue a request; its codec chunks arrive on the returned stream. Call from the asyncio loop."""
        self._check_running()
        self._validate(request)
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

    @staticmethod
    def _validate(request: SynthesisRequest) -> None:
        request.sampling.validate()
        if request.max_frames < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1")

    def _check_fits(self, seq: Sequence) -> None:
        if seq.max_positions > self.config.max_seq_len:
            raise InvalidRequestError(
                f"request too long: prompt of {seq.prompt_len} positions + {seq.request.max_frames} frames exceeds "
                f"the engine's max_seq_len {self.config.max_seq_len}"
            )
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
        seq.output = _Output(stream, chunker)
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
        `abort` works as for `add_request`.
        KV: the request reserves prompt + `max_frames` + 2 positions like any other: in the streaming-text
        layout the prompt's length does not depend on the text, and the text itself takes no KV position
        beyond one per frame (it is added to the frames' inputs), so `max_frames` is the declared maximum.
        """
        self._check_running()
        prompt = request.prompt
        if prompt.non_streaming_text:
            raise InvalidRequestError("live text needs the streaming-text layout (non_streaming_text=False)")
        if prompt.text_ids:
            raise InvalidRequestError("a live request's text comes through append_text, not its prompt")
        if request.request_id in self._texts:
            raise InvalidRequestError(f"request {request.request_id!r} is already open")
        self._validate(request)
        # the prefill's length does not depend on the text in this layout: one placeholder id sizes it
        idle_limit = self.config.text_idle_timeout_s
        if idle_timeout_s is not None and not 0 < idle_timeout_s:
            raise InvalidRequestError("the text idle timeout must be > 0")
        live = LiveText(prompt, self.model.config.text_ids.tts_eos, time.monotonic(),
                        min(idle_timeout_s or idle_limit, idle_limit))
        seq = Sequence(request, 0, prefill_length(replace(prompt, text_ids=(0,))), 0, output=None, live=live)
        self._check_fits(seq)
        stream = self._output(seq, schedule)
        live.seed = seq.seed
        stream.on_end = self._forget_text
        self._texts[request.request_id] = TextStream(self.model.tokenizer)
        self._adds_sent += 1
        self._commands.put(("open", seq))
        self._wake.set()
        if text:
            self.append_text(request.request_id, text)
        return stream

    def append_text(self, request_id: str, text: str) -> None:
        """More text for an open request. Only ids that later text cannot change are sent to the engine (the
        last word waits for the next one, or for `flush_text`/`end_text`)."""
        self._send_text(request_id, self._text_stream(request_id).append(text))

    def flush_text(self, request_id: str) -> None:
        """Speak the text so far as if it ended here, without closing: the held-back tail is released and the
        text so far is one utterance, spoken to its end (eos, then pad text rows, until the codec's EOS). Text
        after it is the next utterance, spoken after it on the same stream (a new prefill of the same prompt,
        in the request's slot and KV; `max_frames` counts all of them)."""
        piece = self._text_stream(request_id).flush()
        if piece is not None:
            self._send_text(request_id, piece)

    def end_text(self, request_id: str) -> None:
        """The text is complete: the request finishes normally (codec EOS or `max_frames`)."""
        piece = self._text_stream(request_id).end()
        del self._texts[request_id]
        self._send_text(request_id, piece)

    def _text_stream(self, request_id: str) -> TextStream:
        stream = self._texts.get(request_id)
        if stream is None:
            raise InvalidRequestError(f"request {request_id!r} is not open for text (unknown, ended or finished)")
        return stream

    def _send_text(self, request_id: str, piece: TextPiece | None) -> None:
        # pieces without ids still count as text arriving (the idle timeout), so they are sent too
        self._commands.put(("text", (request_id, piece)))
        self._wake.set()

    def _forget_text(self, request_id: str) -> None:
        self._texts.pop(request_id, None)  # the stream ended (consumer's loop): appends now raise

    def run_on_device(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run `fn` on the engine's device thread between steps (e.g. voice-clone encoders).

        Keeps one thread owning all device work of the replica; the caller awaits the future
        (`asyncio.wrap_future`). Use for short work: running requests wait while it runs.
        """
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
        sched = self.scheduler
        if sched is None:
            return EngineStats(self._adds_queued, 0, 0, 0, 0, 0, 0)
        return EngineStats(
            waiting=sched.num_waiting + self._adds_queued, running=sched.num_running, max_running=self.num_slots,
            kv_reserved_tokens=sched.reserved_positions,
            kv_total_tokens=sched.blocks.num_blocks * sched.blocks.block_size, steps=self._steps,
            frames=self._frames, prefills=self._prefills, burst_prefills=self._burst_prefills,
            held_admissions=self._held_admissions,
            prefill_seconds=self._prefill_seconds,
            step_seconds=self._step_seconds, device_wait_seconds=self._device_wait,
            host_bound_steps=self._host_bound_steps, parked=sched.num_parked, held=sched.num_held,
            admitted=self._admitted, admission_wait_seconds=self._admission_wait,
            command_wait_seconds=self._command_wait,
            first_chunks=self._first_chunks, first_chunk_seconds=self._first_chunk_wait,
            # a copy (the engine thread adds on); none while the runner is still being built (graph capture)
            device_clock=replace(self.runner.step_clock.stats) if self.runner is not None else DeviceClockStats(),
        )

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
        cfg, model = self.config, self.model
        tcfg = model.config.talker.transformer
        per_token = PagedKVCache.bytes_per_token(tcfg.num_hidden_layers, tcfg.num_key_value_heads, tcfg.head_dim,
                                                 model.dtype)
        budget_tokens = cfg.kv_cache_tokens
        if budget_tokens is None:
            if model.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(model.device)
                budget_tokens = int(free * cfg.kv_cache_memory_fraction) // per_token
            else:
                budget_tokens = cfg.max_num_seqs * cfg.max_seq_len
        num_blocks = max(1, budget_tokens // cfg.kv_block_size)  # requests bigger than the pool get a 400
        self.num_slots = cfg.max_num_seqs
        self.scheduler = Scheduler(self.num_slots, num_blocks, cfg.kv_block_size, cfg.max_prefill_batch,
                                   cfg.max_waiting)
        log(f"[talker] KV pool: {num_blocks} blocks x {cfg.kv_block_size} positions "
            f"({num_blocks * cfg.kv_block_size * per_token / 2**30:.2f} GiB), {self.num_slots} rows")
        use_compile = cfg.compile and model.device.type == "cuda"
        compile_cache = None
        if use_compile:
            if cfg.compile_cache_dir:
                shapes = {"talker": repr(model.config.talker), "dtype": str(model.dtype)}
                compile_cache = CompileCache.for_model(cfg.compile_cache_dir, model.device, shapes,
                                                       sources=COMPILED_SOURCES, dynamo=cfg.compile_cache_dynamo)
                compile_cache.load(log)
            log("[talker] compiling fused kernels" + (" (from the compile cache)" if compile_cache and
                                                       compile_cache.loaded else ""))
        self.runner = self._runner_factory(
            model, self.num_slots, cfg.max_seq_len, cfg.max_text_rows, num_blocks, cfg.kv_block_size,
            cfg.length_buckets, compile=use_compile, attention_kernel=cfg.attention_kernel,
            max_prefill_batch=cfg.max_prefill_batch, prefill_widths=cfg.prefill_widths,
            prefill_batches=cfg.prefill_batches, gemv_rows=cfg.gemv_rows,
            heads_in_attention=cfg.heads_in_attention, sampling_kernel=cfg.sampling_kernel, pdl=cfg.pdl,
            attention_splits=cfg.attention_splits)
        self._exact = model.device.type != "cuda" if cfg.exact_prefill is None else cfg.exact_prefill
        self._buckets = tuple(sorted({min(b, self.num_slots) for b in cfg.batch_buckets} | {self.num_slots}))
        # host bookkeeping per ticket (see Scheduler): frames of each running request, and positions launched
        self._codes = np.zeros((self.num_slots, cfg.max_seq_len, NUM_CODEBOOKS), dtype=np.int16)
        self._launched_pos = np.zeros(self.num_slots, dtype=np.int64)
        self._launched_steps = np.zeros(self.num_slots, dtype=np.int64)
        # per ticket, for admission's lead check: when the audio handed out so far ends if its listener plays it
        # from the first chunk on without a pause (a pause: playback resumes with the next chunk); inf: no chunk yet
        self._play_end = np.full(self.num_slots, np.inf)
        self._by_ticket: list[Sequence | None] = [None] * self.num_slots
        if cfg.cuda_graphs and model.device.type == "cuda":
            log(f"[talker] capturing CUDA graphs for batch buckets {self._buckets} x "
                f"length buckets {self.runner.length_buckets}")
            self.graph_capture_seconds = self.runner.capture_graphs(self._buckets, log)
            log(f"[talker] graph capture took {self.graph_capture_seconds:.1f} s")
        if compile_cache is not None:
            compile_cache.save(log)

    def _loop(self) -> None:
        sched = self.scheduler
        pending = None  # the launched step not yet read
        while not self._stop:
            self._drain_commands(block=not (sched.running or sched.waiting or sched.restarts or pending))
            if self._stop:
                break
            self._expire_text_waits()
            self._admit_batches()
            launched = self._launch()
            if pending is not None:
                self._process(pending)
            pending = launched
        if pending is not None:
            self._process(pending)

    def _drain_commands(self, block: bool) -> None:
        if block:  # idle; requests waiting for text may time out meanwhile
            timeout = self._expiry_at - time.monotonic() if self._expiry_at < float("inf") else None
            self._wake.wait(None if timeout is None else max(timeout, 0.0))
        self._wake.clear()
        sched = self.scheduler
        for kind, payload in self._queued_commands():
            if self._take_new_request(kind, payload):
                if kind == "open":
                    self._wait_for_text(payload)
            elif kind == "text":
                try:
                    self._on_text(*payload)
                except Exception as e:  # host-side trouble with one request's text: that request fails alone
                    logger.exception("live text of request %s failed", payload[0])
                    seq = sched.get(payload[0])
                    if seq is not None:
                        self._finish_live(seq, e)
            elif kind == "abort":
                seq = sched.abort(payload)
                if seq is not None and seq.ticket < 0:  # was queued or held: it leaves with no prefill and no row
                    self._end(seq, FinishReason.ABORTED)
                elif seq is not None:  # running: its row frees now (a step in flight still computes it: dropped);
                    self._release([(seq, FinishReason.ABORTED)])  # parked: its slot and KV
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
            self._command_wait += time.monotonic() - payload.enqueued_at
            self._arrivals.add(1)
        elif kind == "open":
            self.scheduler.hold(payload)
        else:
            return False
        self._adds_drained += 1
        return True

    def _admit_batches(self) -> None:
        """One admission, or a burst of up to max_prefills_per_step while no running stream would feel the wait:
        each extra prefill delays the next step by its own time, so a burst runs only while every running
        stream has at least admission_lead_s of handed-out audio not yet played (`_play_end`: a listener plays
        from its first chunk's hand-over on and resumes after a pause, e.g. a live stream waiting for text, when
        the next chunk comes; one without a chunk yet is not playing).

        A burst's requests are admitted together and prefilled shortest prompt first, max_prefill_batch at a
        time: one step follows them all, so their order changes no one's first frame, and a batch pads to its
        longest prompt's width (prompts of like length share a width). A failed prefill fails its batch alone."""
        cfg, sched = self.config, self.scheduler
        if self._holds_admission():
            self._held_admissions += 1
            return
        lacks_lead = sched.num_running and self._min_lead_s() < cfg.admission_lead_s
        batch_size = cfg.max_prefill_batch
        admitted = sched.admit(limit=batch_size * (1 if lacks_lead else cfg.max_prefills_per_step))
        if len(admitted) > batch_size:
            admitted.sort(key=lambda s: s.plan.length)
        failed: list[tuple[Sequence, BaseException]] = []
        prefilled = 0
        for start in range(0, len(admitted), batch_size):
            batch = admitted[start:start + batch_size]
            error = self._prefill(batch)
            if error is not None:
                failed += [(s, error) for s in batch]
                continue
            if prefilled:
                self._burst_prefills += 1
            prefilled += 1
        self._release(failed)  # their rows fill from later ones, their streams end with the error

    def _holds_admission(self) -> bool:
        """Whether this iteration's admission waits for more arrivals (`prefill_hold_s`): a prefill costs about
        the same for one request as for a batch, so under load a few that arrive over a step or two share one.
        Never with nothing running (the device would idle), never for a restart, a full batch or a request that
        has waited the hold, and only when at least one more arrival is expected within the hold (at light load
        waiting would only delay this one). The running streams' lead does not matter: a held admission delays
        only the waiting requests, and the steps go on without a prefill between them. (It once required every
        playing stream to have admission_lead_s of audio ahead, and so never held at 256-512 streams per GPU,
        where some new stream always lacks it: H100, 2026-11-28.)"""
        cfg, sched = self.config, self.scheduler
        if cfg.prefill_hold_s <= 0 or not sched.waiting or sched.restarts or not sched.num_running:
            return False
        if len(sched.waiting) >= cfg.max_prefill_batch:
            return False
        if time.monotonic() - sched.waiting[0].enqueued_at >= cfg.prefill_hold_s:
            return False
        return self._arrivals.wait_if_more_expected(cfg.prefill_hold_s)

    def _min_lead_s(self) -> float:
        """The least lead among running streams: audio handed out not yet played (inf: none is playing)."""
        return float(self._play_end[self._running_tickets()].min() - time.monotonic())

    def _running_tickets(self) -> np.ndarray:
        """The running requests' tickets, in row order."""
        sched = self.scheduler
        return np.fromiter((s.ticket for s in sched.running), dtype=np.int64, count=sched.num_running)

    def _prefill(self, batch: list[Sequence]) -> BaseException | None:
        """One batched prefill of admitted requests (their rows, tickets and KV blocks are theirs already);
        the error if it failed (the caller releases the batch with it)."""
        sched, runner = self.scheduler, self.runner
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
            t = s.ticket
            if s.admitted_at is None:
                s.admitted_at = now
                self._admitted += 1
                self._admission_wait += now - s.enqueued_at
                self._play_end[t] = np.inf  # not playing yet
            self._by_ticket[t] = s
            self._launched_pos[t] = s.prompt_len
            self._launched_steps[t] = sched.frames[t]  # 0, or (a live request's next segment) its frames so far
            sched.next_cut[t] = sched.frames[t] + s.output.chunker.frames_to_next_chunk
            if s.live is not None:  # its text rows follow in this iteration's text write
                s.live.written = 0
                sched.text_limit[t] = s.live.text_limit()
                self._text_dirty[id(s)] = s
        self._prefills += 1
        self._prefill_seconds += time.perf_counter() - t0
        self._progress_at = time.monotonic()
        if self.on_admit is not None:
            self.on_admit([s.request_id for s in batch])
        return None

    def _launch(self) -> tuple[int, int, np.ndarray, np.ndarray] | None:
        """Launch the next step for every running row, unless no row can use it: rows that already have a step
        launched for their last frame (max_frames) need none, and an idle GPU takes the next prefill at once."""
        sched, runner = self.scheduler, self.runner
        if sched.num_running == 0:
            return None
        t0 = time.perf_counter()
        tickets = self._park_starved(self._running_tickets())  # live text: rows whose next text is not there leave first
        if self._text_dirty:
            self._write_text()
        n = len(tickets)
        if n == 0 or not (self._launched_steps[tickets] < sched.max_frames[tickets]).any():
            return None
        self._launched_steps[tickets] += 1
        positions = self._launched_pos[tickets]
        attn_len = runner.attn_bucket(int(positions.max()))
        turn = runner.launch_step(next(x for x in self._buckets if x >= n), attn_len)
        self._launched_pos[tickets] = positions + 1
        self._step_seconds += time.perf_counter() - t0
        return turn, n, tickets, sched.generation[tickets].copy()

    def _process(self, launched: tuple[int, int, np.ndarray, np.ndarray]) -> None:
        """Bookkeeping of one finished step, vectorized over its rows."""
        turn, n, tickets, generations = launched
        t0 = time.perf_counter()
        sched, eos = self.scheduler, self.runner.eos
        out = self.runner.step_output(turn, n)
        waited = time.perf_counter() - t0  # the bookkeeping before the read is a few attribute reads
        self._device_wait += waited
        self._host_bound_steps += waited < HOST_BOUND_WAIT_S
        self._steps += 1
        self._progress_at = time.monotonic()
        live = sched.live[tickets] & (sched.generation[tickets] == generations)
        eos_now = out[:, 0] == eos  # the frame's codebook 0 is EOS (sampled at prefill): nothing to hand out
        deliver = live & ~eos_now
        t_del = tickets[deliver]
        self._codes[t_del, sched.frames[t_del]] = out[deliver, :NUM_CODEBOOKS]
        sched.frames[t_del] += 1
        self._frames += len(t_del)
        frames = sched.frames[tickets]
        ended_eos = live & (eos_now | (out[:, NUM_CODEBOOKS] == eos))
        ended_len = live & ~ended_eos & (frames >= sched.max_frames[tickets])
        starved = live & (frames >= sched.text_limit[tickets])  # live text: no frame until more text arrives
        cut = live & ((frames >= sched.next_cut[tickets]) | starved)
        deliveries, finished, segment_ends = [], [], []
        for i in np.flatnonzero(ended_eos | ended_len | cut):
            t = int(tickets[i])
            seq = self._by_ticket[t]
            o = seq.output
            try:
                chunks = o.chunker.push(self._codes[t, o.pushed:frames[i]]) if frames[i] > o.pushed else []
            except ValueError as e:  # codes the decoder cannot take: this request fails, nobody else
                logger.error("request %s produced invalid codes: %s", seq.request_id, e)
                finished.append((seq, e))
                continue
            o.pushed = int(frames[i])
            if ended_eos[i] and seq.live is not None and seq.live.speaks_on_after_eos():
                chunks.append(o.chunker.cut())  # a flushed segment is spoken to its end; more text may follow
                segment_ends.append(seq)
            elif ended_eos[i] or ended_len[i]:
                reason = FinishReason.EOS if ended_eos[i] else FinishReason.LENGTH
                chunks.append(o.chunker.flush(reason))
                finished.append((seq, reason))
            else:
                if starved[i]:  # waiting for text: the listener gets every frame so far
                    chunks.append(o.chunker.cut())
                sched.next_cut[t] = frames[i] + o.chunker.frames_to_next_chunk
            chunks = [c for c in chunks if c is not None]
            if chunks:
                deliveries.append((o.stream, chunks))
                new_frames = sum(c.num_new for c in chunks)
                if new_frames:  # the listener's buffer: it plays on from where it is, or from now after a pause
                    now = time.monotonic()
                    end = self._play_end[t]
                    self._play_end[t] = (now if end == np.inf else max(end, now)) + new_frames * FRAME_SECONDS
                if seq.first_chunk_at is None and new_frames:
                    seq.first_chunk_at = now
                    self._first_chunks += 1
                    self._first_chunk_wait += seq.first_chunk_at - seq.enqueued_at
        ChunkStream.deliver_many(deliveries)
        self._release(finished)
        for seq in segment_ends:
            self._next_segment(seq)
        self._step_seconds += time.perf_counter() - t0

    def _release(self, finished: list[tuple[Sequence, FinishReason | BaseException]]) -> None:
        """Free the rows (moving the last rows into the holes) and KV blocks, then end the streams."""
        if not finished:
            return
        sched = self.scheduler
        before = sched.num_running
        for seq, _ in finished:
            self._by_ticket[seq.ticket] = None
            self._text_dirty.pop(id(seq), None)
        self._move_rows(sched.release([s for s, _ in finished]))
        self._free_rows(before)
        # streams end only once the rows are free: a consumer that sees the end then reads stats sees them free
        for seq, outcome in finished:
            self._end(seq, outcome)

    # ------------------------------------------------------------------ live text (engine thread)
    def _on_text(self, request_id: str, piece: TextPiece | None) -> None:
        """Text for a live request: it may become prefillable, resume where it waited, or finish."""
        sched = self.scheduler
        seq = sched.get(request_id)
        if seq is None or seq.live is None or seq.aborted:
            return  # finished meanwhile (EOS, length, timeout): its text is not needed any more
        live = seq.live
        live.last_text_at = time.monotonic()
        if piece is None:
            return
        live.add(piece)
        if live.longest_trailing() > self.config.max_text_rows:
            self._finish_live(seq, InvalidRequestError(
                f"input text too long (more than {self.config.max_text_rows} text positions in one utterance)"))
            return
        if seq.ticket >= 0:
            sched.text_limit[seq.ticket] = live.text_limit()
            self._text_dirty[id(seq)] = seq
        if request_id in sched.held:
            if live.can_prefill():
                self._prepare_prefill(seq)
                sched.enqueue(seq)
            elif live.finished:  # ended without a word
                self._finish_live(seq, InvalidRequestError("input text is empty"))
        elif seq.restart and seq not in sched.restarts:  # between segments
            if live.can_prefill():
                self._prepare_prefill(seq)
                sched.requeue(seq)
            elif live.finished:
                self._finish_live(seq, FinishReason.EOS)
        elif (request_id in sched.parked and not seq.restart
              and self._launched_steps[seq.ticket] < live.text_limit()):
            self._unpark(seq)

    def _prepare_prefill(self, seq: Sequence) -> None:
        """The plan of the current segment's prefill; its trailing rows come through `write_text`."""
        live = seq.live
        seq.prompt = live.prefill_prompt()
        plan = plan_prompt(self.model.config, seq.prompt)
        seq.plan = replace(plan, trailing_ids=plan.trailing_ids[:0])
        seq.trailing_len = 0
        # each segment draws its own random stream (the counter restarts at frame 0 with every prefill)
        seq.seed = (live.seed + live.first_segment * 0x9E3779B1) & 0x7FFFFFFF
        live.waiting_since = None

    def _park_starved(self, tickets: np.ndarray) -> np.ndarray:
        """Running requests whose next step needs text not there yet leave the rows (state saved by ticket, KV
        kept); the last rows fill their holes. Returns the tickets still running, by row."""
        sched, runner = self.scheduler, self.runner
        starved = self._launched_steps[tickets] >= sched.text_limit[tickets]
        if not starved.any():
            return tickets
        seqs = [sched.running[r] for r in np.flatnonzero(starved)]
        for seq in seqs:  # saved before any row moves into theirs (device order: after the step in flight)
            runner.park_row(seq.row, seq.ticket)
        before = sched.num_running
        self._move_rows(sched.park(seqs))
        self._free_rows(before)
        for seq in seqs:
            self._wait_for_text(seq)
        self.parks += len(seqs)
        self._progress_at = time.monotonic()
        return self._running_tickets()

    def _unpark(self, seq: Sequence) -> None:
        """A parked request has its next text: it continues at the end of the rows, where it stopped."""
        sched = self.scheduler
        row = sched.unpark(seq)
        self.runner.unpark_row(seq.ticket, row)
        live = seq.live
        live.written = int(self._launched_steps[seq.ticket]) - live.frame_base  # its next text row is the first
        seq.trailing_len = live.written
        live.waiting_since = None
        self._text_dirty[id(seq)] = seq
        self.unparks += 1
        self._progress_at = time.monotonic()

    def _write_text(self) -> None:
        """New trailing text rows of running live requests, all in one staged write."""
        writes = []
        for key, seq in list(self._text_dirty.items()):
            if seq.row < 0:
                continue  # parked: written once it has a row again
            start, ids = seq.live.take_trailing()
            if ids:
                writes.append((seq.row, start, np.asarray(ids, dtype=np.int64)))
            seq.trailing_len = seq.live.written
            del self._text_dirty[key]
        if writes:
            self.runner.write_text(writes)

    def _next_segment(self, seq: Sequence) -> None:
        """A flushed segment was spoken to its end (codec EOS): the request leaves its row, keeps its slot and
        KV, and prefills its next segment when that has text (or finishes if the text has ended)."""
        sched = self.scheduler
        before = sched.num_running
        self._move_rows(sched.park([seq], restart=True))
        self._free_rows(before)
        seq.restart = True  # also when it was parked already (waiting for text when its EOS was read)
        sched.generation[seq.ticket] = next(sched._gen)  # the step launched after its EOS is dropped
        live = seq.live
        live.next_segment(int(sched.frames[seq.ticket]))
        sched.text_limit[seq.ticket] = live.text_limit()
        self._text_dirty.pop(id(seq), None)
        if live.can_prefill():
            self._prepare_prefill(seq)
            sched.requeue(seq)
        elif live.finished:
            self._finish_live(seq, FinishReason.EOS)
        else:
            self._wait_for_text(seq)

    def _wait_for_text(self, seq: Sequence) -> None:
        now = time.monotonic()
        seq.live.waiting_since = now
        self._expiry_at = min(self._expiry_at, now + seq.live.idle_timeout_s)

    def _expire_text_waits(self) -> None:
        """Requests that waited for text longer than their idle timeout end with `TextTimeoutError`."""
        now = time.monotonic()
        if now < self._expiry_at:
            return
        sched = self.scheduler
        self._expiry_at = float("inf")
        expired = []
        for seq in [*sched.held.values(), *sched.parked.values()]:
            live = seq.live
            if live is None or live.waiting_since is None:
                continue
            deadline = max(live.waiting_since, live.last_text_at) + live.idle_timeout_s
            if deadline <= now:
                expired.append(seq)
            else:
                self._expiry_at = min(self._expiry_at, deadline)
        for seq in expired:
            timeout = seq.live.idle_timeout_s
            self._finish_live(seq, TextTimeoutError(f"no text for {timeout:g} s: request {seq.request_id!r} ended"))
        if expired:
            self._progress_at = now

    def _finish_live(self, seq: Sequence, outcome: FinishReason | BaseException) -> None:
        """End a live request in any state: its frames so far are delivered first (an error ends it after them)."""
        o, sched = seq.output, self.scheduler
        if seq.ticket >= 0:
            t = seq.ticket
            frames = int(sched.frames[t])
            chunks = o.chunker.push(self._codes[t, o.pushed:frames]) if frames > o.pushed else []
            o.pushed = frames
            chunks.append(o.chunker.flush(outcome) if isinstance(outcome, FinishReason) else o.chunker.cut())
            chunks = [c for c in chunks if c is not None]
            if chunks:
                ChunkStream.deliver_many([(o.stream, chunks)])
            sched.live[t] = False
            self._release([(seq, outcome)])
        else:
            sched.abort(seq.request_id)  # held or queued: it leaves
            self._end(seq, outcome)
        self._text_dirty.pop(id(seq), None)

    def _move_rows(self, moves: list[RowMove]) -> None:
        """The scheduler's row moves, done by the runner in one batch."""
        running = self.scheduler.running
        self.runner.move_rows([(m.src, m.dst, running[m.dst].trailing_len) for m in moves])

    def _free_rows(self, before: int) -> None:
        """Rows [running, before) are free now: their KV tables point at the scratch block again."""
        self.runner.free_rows(self.scheduler.num_running, before)

    @staticmethod
    def _end(seq: Sequence, outcome: FinishReason | BaseException) -> None:
        """The end of a request's stream (its last chunk, if any, was delivered before)."""
        ChunkStream.deliver_many([(seq.output.stream, [ChunkStream.end(outcome)])])

    def _end_all(self, error: BaseException) -> None:
        sched = self.scheduler
        if sched is None:
            return
        for kind, payload in self._queued_commands():  # requests still in the command queue end below too
            if not self._take_new_request(kind, payload) and kind == "call":
                payload[1].set_exception(error)
        for seq in sched.drop_all():
            seq.output.stream.fail(error)
