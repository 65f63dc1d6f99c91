"""TalkerEngine: continuous batching of talker requests on one device thread, driven from asyncio.

One thread owns every GPU operation (CUDA graphs are captured and replayed there). Requests enter
through a thread-safe command queue; frames leave through per-request `FrameStream`s, delivered to
the caller's event loop in one callback per step. Every step the thread admits waiting requests
(batched prefill into free slots, as far as KV capacity allows) and advances every running request
by one frame in one batched decode step.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from stages.contract import EngineOverloadedError, FinishReason, InvalidRequestError, SynthesisRequest
from stages.model import Qwen3TTS
from stages.talker.frame import CODEBOOKS
from stages.talker.kv_slots import SlotKVCache
from stages.talker.prefill import build_prefill, prefill_length, trailing_length
from stages.talker.runner import TalkerRunner
from stages.talker.stream import FrameStream


@dataclass(frozen=True)
class TalkerEngineConfig:
    max_batch_size: int = 64  # slots at most (running requests)
    max_seq_len: int = 2048  # prompt + frames per request (KV positions of one slot)
    kv_cache_tokens: int | None = None  # total KV budget in tokens; None: from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.5  # of free device memory after weights (CUDA only)
    max_text_rows: int = 1024  # trailing text rows per request (longest streaming-text input)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    length_buckets: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    max_prefill_batch: int = 16  # requests admitted in one batched prefill
    max_waiting: int = 4096  # queued requests at most; more are refused (overload)
    cuda_graphs: bool = True
    compile: bool = True  # torch.compile the per-layer math and sampling (CUDA only)

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.max_seq_len < 16:
            raise ValueError("max_batch_size must be >= 1 and max_seq_len >= 16")


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    max_running: int
    kv_used_tokens: int
    kv_total_tokens: int
    steps: int
    frames: int
    prefills: int = 0  # batched prefills run (admissions)
    prefill_seconds: float = 0.0  # device-thread time spent in them (decode steps wait meanwhile)
    step_seconds: float = 0.0  # device-thread time spent in decode steps (incl. handing frames out)


@dataclass
class _Request:
    request: SynthesisRequest
    stream: FrameStream
    prompt_len: int
    seed: int
    frames: int = 0
    aborted: bool = False
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def worst_case_len(self) -> int:
        return self.prompt_len + self.request.max_frames + 1


class TalkerEngine:
    def __init__(self, model: Qwen3TTS, config: TalkerEngineConfig = TalkerEngineConfig()):
        if model.talker is None:
            raise ValueError("TalkerEngine needs a model loaded with its talker")
        self.model, self.config = model, config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._ready = threading.Event()
        self._stop = False
        self._error: BaseException | None = None
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._seed_counter = itertools.count(int(time.time_ns() % (1 << 31)))
        self._steps = self._frames = self._prefills = 0
        self._prefill_seconds = self._step_seconds = 0.0
        self.num_slots = 0
        self.graph_capture_seconds = 0.0
        self._thread: threading.Thread | None = None
        self.runner: TalkerRunner | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, log: Callable[[str], None] = print, timeout: float | None = None) -> None:
        """Start the device thread: size the KV cache, capture graphs, warm up. Blocks until ready."""
        self._thread = threading.Thread(target=self._main, args=(log,), name="talker-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError("talker engine did not become ready in time")
        if self._error is not None:
            raise RuntimeError("talker engine failed to start") from self._error

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    # ------------------------------------------------------------------ API (event-loop side)
    def add_request(self, request: SynthesisRequest) -> FrameStream:
        """Queue a request; frames arrive on the returned stream. Call from the asyncio loop."""
        if self._error is not None:
            raise RuntimeError("talker engine has failed") from self._error
        request.sampling.validate()
        if request.max_frames < 1:
            raise InvalidRequestError("max_new_tokens must be >= 1")
        prompt_len = prefill_length(request.prompt)
        if prompt_len + request.max_frames + 1 > self.config.max_seq_len:
            raise InvalidRequestError(
                f"request too long: prompt of {prompt_len} positions + {request.max_frames} frames exceeds "
                f"the engine's max_seq_len {self.config.max_seq_len}"
            )
        if trailing_length(request.prompt) > self.config.max_text_rows:
            raise InvalidRequestError(f"input text too long ({len(request.prompt.text_ids)} tokens)")
        if len(self._waiting) >= self.config.max_waiting:
            raise EngineOverloadedError(f"{len(self._waiting)} requests already waiting")
        seed = request.seed if request.seed is not None else next(self._seed_counter)
        stream = FrameStream(request.request_id, asyncio.get_running_loop(), on_close=self.abort)
        self._commands.put(("add", _Request(request, stream, prompt_len, seed & 0x7FFFFFFF)))
        self._wake.set()
        return stream

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
        """Stop a request at the next step boundary and free its slot. Safe from any thread."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> EngineStats:
        running = list(self._running)
        return EngineStats(
            waiting=len(self._waiting) + self._commands.qsize(), running=len(running), max_running=self.num_slots,
            kv_used_tokens=sum(r.worst_case_len for r in running),
            kv_total_tokens=self.num_slots * self.config.max_seq_len, steps=self._steps, frames=self._frames,
            prefills=self._prefills, prefill_seconds=self._prefill_seconds, step_seconds=self._step_seconds,
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
            while not self._stop:
                self._drain_commands(block=not (self._running or self._waiting))
                self._admit()
                if self._running:
                    t0 = time.perf_counter()
                    self._step()
                    self._step_seconds += time.perf_counter() - t0
        except BaseException as e:  # fail every stream loudly rather than hang them
            self._error = e
            for r in [*self._running, *self._waiting]:
                r.stream.fail(e)
            self._running.clear()
            self._waiting.clear()
            raise

    def _setup(self, log: Callable[[str], None]) -> None:
        cfg, model = self.config, self.model
        tcfg = model.config.talker.transformer
        per_token = SlotKVCache.bytes_per_token(tcfg.num_hidden_layers, tcfg.num_key_value_heads, tcfg.head_dim,
                                                model.dtype)
        budget_tokens = cfg.kv_cache_tokens
        if budget_tokens is None:
            if model.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(model.device)
                budget_tokens = int(free * cfg.kv_cache_memory_fraction) // per_token
            else:
                budget_tokens = cfg.max_batch_size * cfg.max_seq_len
        self.num_slots = max(1, min(cfg.max_batch_size, budget_tokens // cfg.max_seq_len))
        log(f"[talker] KV cache: {self.num_slots} slots x {cfg.max_seq_len} positions "
            f"({self.num_slots * cfg.max_seq_len * per_token / 2**30:.2f} GiB)")
        use_compile = cfg.compile and model.device.type == "cuda"
        if use_compile:
            log("[talker] compiling fused kernels (first start compiles, later starts reuse the cache)")
        self.runner = TalkerRunner(model, self.num_slots, cfg.max_seq_len, cfg.max_text_rows, cfg.length_buckets,
                                   compile=use_compile)
        self._buckets = tuple(sorted({min(b, self.num_slots) for b in cfg.batch_buckets} | {self.num_slots}))
        if cfg.cuda_graphs and model.device.type == "cuda":
            log(f"[talker] capturing CUDA graphs for batch buckets {self._buckets} x "
                f"length buckets {self.runner.length_buckets}")
            self.graph_capture_seconds = self.runner.capture_graphs(self._buckets, log)
            log(f"[talker] graph capture took {self.graph_capture_seconds:.1f} s")

    def _drain_commands(self, block: bool) -> None:
        if block:
            self._wake.wait()
        self._wake.clear()
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._waiting.append(payload)
                self._by_id[payload.request.request_id] = payload
            elif kind == "abort":
                r = self._by_id.get(payload)
                if r is not None:
                    r.aborted = True
            elif kind == "call":
                fn, future = payload
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's error, not the engine's
                        future.set_exception(e)
        # aborted requests that never started leave the queue at once
        if any(r.aborted for r in self._waiting):
            for r in [r for r in self._waiting if r.aborted]:
                self._waiting.remove(r)
                self._finish(r, FinishReason.ABORTED)

    def _admit(self) -> None:
        runner = self.runner
        while self._waiting and len(self._running) < self.num_slots:
            room = min(self.num_slots - len(self._running), self.config.max_prefill_batch)
            batch = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            start = len(self._running)
            t0 = time.perf_counter()
            embeds = [build_prefill(runner.talker, self.model.config, r.request.prompt) for r in batch]
            runner.prefill(start, embeds, [r.request.sampling for r in batch], [r.seed for r in batch])
            self._running.extend(batch)
            first = runner.first_tokens(start, len(batch))  # syncs: the time below is the device's too
            self._prefills += 1
            self._prefill_seconds += time.perf_counter() - t0
            done = [r for r, c0 in zip(batch, first, strict=True) if c0 == runner.eos]
            self._release([(r, FinishReason.EOS) for r in done])

    def _step(self) -> None:
        runner = self.runner
        aborted = [(r, FinishReason.ABORTED) for r in self._running if r.aborted]
        if aborted:
            self._release(aborted)
            if not self._running:
                return
        n = len(self._running)
        b = next(x for x in self._buckets if x >= n)
        max_pos = max(r.prompt_len + r.frames for r in self._running)
        out = runner.decode(b, runner.attn_bucket(max_pos)).numpy()
        self._steps += 1
        self._frames += n
        deliveries = []
        finished = []
        for i, r in enumerate(self._running):
            r.frames += 1
            deliveries.append((r.stream, out[i, :CODEBOOKS].copy()))
            if out[i, CODEBOOKS] == runner.eos:
                finished.append((r, FinishReason.EOS))
            elif r.frames >= r.request.max_frames:
                finished.append((r, FinishReason.LENGTH))
        FrameStream.deliver_many(deliveries)
        self._release(finished)

    def _release(self, finished: list[tuple[_Request, FinishReason]]) -> None:
        """Free slots at once, keeping running requests compacted in slots [0, n)."""
        if not finished:
            return
        gone = {id(r) for r, _ in finished}
        keep = [r for r in self._running if id(r) not in gone]
        # move survivors from the top into the holes below len(keep)
        holes = [i for i, r in enumerate(self._running[:len(keep)]) if id(r) in gone]
        movers = [i for i in range(len(keep), len(self._running)) if id(self._running[i]) not in gone]
        for hole, src in zip(holes, movers, strict=True):
            r = self._running[src]
            self.runner.move_slot(src, hole, r.prompt_len + r.frames + 1)
            self._running[hole] = r
        self._running = self._running[:len(keep)]
        # streams end only once the slots are free: a consumer that sees the end then reads stats sees them free
        for r, reason in finished:
            self._finish(r, reason)

    def _finish(self, r: _Request, reason: FinishReason) -> None:
        self._by_id.pop(r.request.request_id, None)
        r.stream.close(reason)
