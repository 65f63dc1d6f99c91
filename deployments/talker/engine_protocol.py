"""What TalkerServer needs of a talker engine: the seam between the Serve shim and `stages.talker.engine`.

`stages.talker.engine.TalkerEngine` is the production engine; `tests.fake_engine.FakeTalkerEngine` implements the
same Protocol without a model (tests/deployments/test_engine_protocols.py checks both). An engine is named by
`engine_cls: "module:Class"` and built with its `config_cls` from `engine_kwargs` (deployments/loading.py), so the
server never imports torch. Members are plain attributes and methods: the server calls them without probing.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator, Callable
from typing import Protocol, runtime_checkable

from stages.chunking import ChunkSchedule
from stages.contract import CodecChunk, SynthesisRequest


class TalkerEngineSettings(Protocol):
    """The engine config fields the server reads."""

    max_seq_len: int  # prompt positions + frames of one request (what the ingress fits requests to)
    max_text_rows: int  # text positions of one utterance (the ingress refuses longer text itself)
    compile: bool  # the engine compiles on CUDA: the first-chunk decoder then compiles too


class TalkerEngineCounters(Protocol):
    """The engine's counters the server reads (autoscaling, metrics, the first-chunk gate)."""

    waiting: int  # added, not yet admitted
    running: int  # on the batch rows
    parked: int  # live text: prefilled, waiting for text (they keep slot and KV)
    held: int  # live text: opened without the text their prefill needs (no slot)
    max_running: int
    kv_reserved_tokens: int
    kv_total_tokens: int
    steps: int
    frames: int


class EngineStream(Protocol):
    """One request's codec chunks in order (the last has `final=True`); `aclose` aborts a request still running."""

    def __aiter__(self) -> AsyncIterator[CodecChunk]: ...

    async def aclose(self) -> None: ...

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` after the chunks it holds (from the event loop or any thread)."""


@runtime_checkable
class TalkerEngineProtocol(Protocol):
    config: TalkerEngineSettings

    @property
    def ready(self) -> bool: ...

    def start(self, log: Callable[[str], None], timeout: float | None) -> None:
        """Blocking: load onto the device, size the KV cache, capture graphs; raises if it cannot."""

    def shutdown(self) -> None:
        """Stop; every open stream ends with an error."""

    def check_health(self) -> None:
        """Raise if the loop died, or made no progress for too long with work pending (a stuck device call)."""

    def add_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None) -> EngineStream:
        """Queue a request (from the event loop); raises InvalidRequestError for one it cannot take."""

    def open_request(self, request: SynthesisRequest, schedule: ChunkSchedule | None = None, text: str = "",
                     idle_timeout_s: float | None = None) -> EngineStream:
        """A live-text request: its text comes through `append_text` / `flush_text` / `end_text`."""

    def append_text(self, request_id: str, text: str) -> None: ...

    def flush_text(self, request_id: str) -> None: ...

    def end_text(self, request_id: str) -> None: ...

    def abort(self, request_id: str) -> None:
        """End the request at the engine's next step (its stream ends as aborted)."""

    def run_on_device(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """`fn()` on the engine's device thread (voice-clone encoders): one thread owns the device's work."""

    def stats(self) -> TalkerEngineCounters: ...

    def recent_steps(self) -> dict:
        """The last steps one by one (stages/talker/step_clock.py, `StepClock.recent_steps`); {} if not kept."""
