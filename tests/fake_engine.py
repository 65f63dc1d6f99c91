"""A fake talker engine behind the Protocol TalkerServer uses (deployments/talker/engine_protocol.py), with faults.

`engine_cls: "tests.fake_engine:FakeTalkerEngine"` (its `config_cls`, `FakeTalkerEngineConfig`, from `engine_kwargs`)
serves requests without a model: a step thread emits one all-zero frame per running request per step
(valid codes for Code2Wav). At most `max_num_seqs` requests run at once; the others wait (FIFO, admitted at
the next step with a free slot) and count as `waiting`, as in the real engine. Faults, chosen per request so a
test drives them through the real HTTP API:

- `pause_seed`: a request with this seed gets `pause_after_frames` frames, then no more (the engine keeps
  stepping for the others): a stream that is mid-way for as long as a test needs, e.g. until its deadline.
- `stall_seed`: admitting a request with this seed makes the loop stop stepping, as a device call that
  never returns would; `check_health()` then raises once no step has happened for `stall_timeout_s`
  while work is pending (the heartbeat the real engine offers).

Live text (`open_request`, `append_text`, `flush_text`, `end_text`): a live request makes one frame per character of
its text (`live_frames_per_char`), waits for more when it has spoken what it has, and ends by EOS once its text
ended and is spoken (or at `max_frames`); no idle timeout. It depends on nothing of stages/talker's internals, so it
keeps working while those change.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from stages.chunking import ChunkSchedule, StreamChunker
from stages.contract import NUM_CODEBOOKS, CodecChunk, FinishReason, InvalidRequestError, SynthesisRequest


@dataclass(frozen=True)
class FakeTalkerEngineConfig:
    max_num_seqs: int = 4
    max_seq_len: int = 512
    max_text_rows: int = 1024
    step_interval_s: float = 0.005
    stall_seed: int | None = None
    pause_seed: int | None = None
    pause_after_frames: int = 4
    live_frames_per_char: int = 1
    stall_timeout_s: float = 1.0
    # accepted and ignored, so that configs written for the real engine work unchanged
    cuda_graphs: bool = False
    kv_cache_tokens: int | None = None
    compile: bool = False  # never compiles (TalkerServer reads it: its first-chunk decoder compiles alongside)


@dataclass(frozen=True)
class FakeEngineStats:
    waiting: int
    running: int
    max_running: int
    kv_used_tokens: int
    kv_total_tokens: int
    steps: int
    frames: int
    stalled: bool
    kv_reserved_tokens: int = 0
    # no live text here: never parked or held (TalkerServer's autoscaling stats and metrics read both)
    parked: int = 0
    held: int = 0


class _Stream:
    """What TalkerServer.generate uses of the engine's stream: async iteration over CodecChunks cut by the
    request's schedule, finish_reason, aclose."""

    def __init__(self, engine: FakeTalkerEngine, request: SynthesisRequest, loop: asyncio.AbstractEventLoop,
                 schedule: ChunkSchedule | None):
        self.request, self._engine, self._loop = request, engine, loop
        self.request_id = request.request_id
        self.finish_reason: FinishReason | None = None
        self.frames = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        self._chunker = StreamChunker(schedule or ChunkSchedule(), request.request_id,
                                      ref_codes=request.prompt.ref_codes)
        self._chunks: collections.deque[CodecChunk] = collections.deque()
        self._ended = False
        self._closed = False
        self.live = False
        self.granted = 0  # a live request's frames its text allows so far
        self.text_ended = False

    def wake_after(self, frames: int) -> None:
        pass

    def put(self, item) -> None:  # engine thread
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> CodecChunk:
        while not self._chunks:
            if self._ended:
                raise StopAsyncIteration
            item = await self._queue.get()
            if isinstance(item, FinishReason):
                self.finish_reason, self._ended = item, True
                last = self._chunker.flush(item)
                if last is not None:
                    self._chunks.append(last)
            elif isinstance(item, BaseException):
                self.finish_reason, self._ended = FinishReason.ERROR, True
                raise item
            else:
                self._chunks.extend(self._chunker.push(item))
        return self._chunks.popleft()

    def fail(self, error: BaseException) -> None:
        self.put(error)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.abort(self.request_id)


class FakeTalkerEngine:
    config_cls: ClassVar[type] = FakeTalkerEngineConfig  # what `engine_kwargs` configure (deployments/loading.py)

    def __init__(self, model, config: FakeTalkerEngineConfig = FakeTalkerEngineConfig()):
        self.model, self.config = model, config
        self._lock = threading.Lock()
        self._running: list[_Stream] = []
        self._waiting: collections.deque[_Stream] = collections.deque()
        self._aborted: set[str] = set()  # request ids
        self._stop = threading.Event()
        self._work = threading.Event()  # set while a request may be running or waiting: an idle loop sleeps on it
        self._ready = False
        self._stalled = False
        self._thread: threading.Thread | None = None
        self.steps = self.frames = 0
        self.last_step = time.monotonic()

    def start(self, log=print, timeout: float | None = None) -> None:
        self._thread = threading.Thread(target=self._loop, name="fake-talker-engine", daemon=True)
        self._thread.start()
        self._ready = True
        log("[fake engine] started")

    def shutdown(self) -> None:
        self._stop.set()
        self._work.set()
        with self._lock:
            streams, self._running, self._waiting = [*self._running, *self._waiting], [], collections.deque()
        for s in streams:
            s.put(RuntimeError("the talker engine shut down"))

    @property
    def ready(self) -> bool:
        return self._ready and not self._stop.is_set()

    def add_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None) -> _Stream:
        stream = _Stream(self, request, asyncio.get_running_loop(), schedule)
        with self._lock:
            if not self._running and not self._waiting:
                self.last_step = time.monotonic()  # idle until now: the heartbeat starts with the work
            self._waiting.append(stream)  # admitted at the next step, when a slot is free
        self._work.set()
        return stream

    def open_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None, text: str = "",
                     idle_timeout_s: float | None = None) -> _Stream:
        stream = self.add_request(request, schedule)
        stream.live = True
        self.append_text(request.request_id, text)
        return stream

    def _live(self, request_id: str) -> _Stream:
        with self._lock:
            for s in (*self._running, *self._waiting):
                if s.request_id == request_id and s.live and not s.text_ended:
                    return s
        raise InvalidRequestError(f"no live request {request_id!r} takes text")

    def append_text(self, request_id: str, text: str) -> None:
        stream = self._live(request_id)
        with self._lock:
            stream.granted += len(text) * self.config.live_frames_per_char

    def flush_text(self, request_id: str) -> None:
        self._live(request_id)

    def end_text(self, request_id: str) -> None:
        stream = self._live(request_id)
        with self._lock:
            stream.text_ended = True

    def live_requests(self) -> list[str]:
        """The live requests running or waiting (not ended, not aborted yet), by id."""
        with self._lock:
            return [s.request_id for s in (*self._running, *self._waiting)
                    if s.live and s.request_id not in self._aborted]

    def run_on_device(self, fn) -> concurrent.futures.Future:
        """`fn()` at once, on the calling thread (no device here)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn())
        except Exception as e:
            future.set_exception(e)
        return future

    def abort(self, request_id: str) -> None:
        """Like the real engine's: a command the loop carries out at its next step (never, once it is stuck)."""
        with self._lock:
            self._aborted.add(request_id)

    def _drop(self, stream: _Stream) -> None:
        with self._lock:
            if stream in self._running:
                self._running.remove(stream)

    def recent_steps(self) -> dict:
        return {}  # no device clock

    def stats(self) -> FakeEngineStats:
        with self._lock:
            running, waiting = len(self._running), len(self._waiting)
        return FakeEngineStats(waiting=waiting, running=running, max_running=self.config.max_num_seqs,
                               kv_used_tokens=0, kv_total_tokens=self.config.max_num_seqs * self.config.max_seq_len,
                               steps=self.steps, frames=self.frames, stalled=self._stalled)

    def check_health(self) -> None:
        with self._lock:
            pending = bool(self._running or self._waiting)
        idle_for = time.monotonic() - self.last_step
        if pending and idle_for > self.config.stall_timeout_s:
            raise RuntimeError(f"talker engine made no step for {idle_for:.1f} s with work pending")

    def _loop(self) -> None:
        while not self._stop.wait(self.config.step_interval_s):
            with self._lock:
                self._running = [s for s in self._running if s.request_id not in self._aborted]
                self._waiting = collections.deque(s for s in self._waiting if s.request_id not in self._aborted)
                self._aborted.clear()
                while self._waiting and len(self._running) < self.config.max_num_seqs:
                    self._running.append(self._waiting.popleft())
                running = list(self._running)
                if not running and not self._waiting:
                    self._work.clear()
            if not running:  # idle: no step until a request comes (a replica of it idles without waking 200 times a s)
                self._work.wait()
                continue
            if self.config.stall_seed is not None and any(s.request.seed == self.config.stall_seed for s in running):
                self._stalled = True  # a device call that never returns: no more steps, ever
                self._stop.wait()
                return
            for s in running:
                if s.request.seed == self.config.pause_seed and s.frames >= self.config.pause_after_frames:
                    continue
                # dropped before its end is put: a consumer that saw the end reads stats without it
                if s.live and s.frames >= s.granted:  # spoken what it has: its end, or a wait for more
                    if s.text_ended:
                        self._drop(s)
                        s.put(FinishReason.EOS)
                    continue
                s.frames += 1
                s.put(np.zeros((1, NUM_CODEBOOKS), dtype=np.int64))
                if s.frames >= s.request.max_frames:
                    self._drop(s)
                    s.put(FinishReason.LENGTH)
            self.steps += 1
            self.frames += len(running)
            self.last_step = time.monotonic()
