"""FrameStream: frames of one request, handed from the engine thread to an asyncio consumer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from stages.contract import FinishReason

_END = object()


class FrameStream:
    """Async iterator of frame blocks (`np.ndarray [n, 16]` int64, n >= 1), in order.

    Each `__anext__` returns every frame that arrived since the last call, so a slow consumer reads
    fewer, larger blocks. `wake_after(n)` lets a consumer that cannot use fewer than n frames (a chunker
    waiting for its next chunk) be woken once per n frames instead of once per frame: the engine thread
    holds frames back until n are there (or the stream ends). With hundreds of streams, per-frame wake-ups
    were event-loop work on every engine step, competing with the engine thread for the GIL.
    `finish_reason` is set when the stream ends. Closing the stream early (`aclose()`, or cancelling
    the consumer) aborts the request in the engine.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_close: Callable[[str], None] | None = None):
        self.request_id = request_id
        self.finish_reason: FinishReason | None = None
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_close = on_close
        self._done = False
        self._error: BaseException | None = None
        self._held: list[np.ndarray] = []  # engine-thread side: frames not yet handed over
        self._wake_after = 1  # written by the consumer, read by the engine thread (an int: atomic enough)

    def wake_after(self, frames: int) -> None:
        """Hand frames over only in blocks of at least `frames` (or at the end of the stream)."""
        self._wake_after = max(1, int(frames))

    # engine-thread side -------------------------------------------------
    @staticmethod
    def deliver_many(items: list[tuple[FrameStream, np.ndarray]]) -> None:
        """Hand one step's frames to their loops: one callback per event loop, not per frame."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, frame in items:
            stream._held.append(frame)
            if len(stream._held) >= stream._wake_after:
                by_loop.setdefault(stream._loop, []).append((stream, stream._held))
                stream._held = []
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(FrameStream._put_all, batch)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    @staticmethod
    def _put_all(batch: list) -> None:
        for stream, frames in batch:
            for frame in frames:
                stream._queue.put_nowait(frame)

    def close(self, reason: FinishReason) -> None:
        self._post((_END, reason))

    def fail(self, error: BaseException) -> None:
        self._post((_END, error))

    def _post(self, end) -> None:
        """The end of the stream, after any frames still held back (engine thread)."""
        held, self._held = self._held, []

        def put() -> None:
            for frame in held:
                self._queue.put_nowait(frame)
            self._queue.put_nowait(end)

        try:
            self._loop.call_soon_threadsafe(put)
        except RuntimeError:
            pass

    # consumer side ----------------------------------------------------------
    def __aiter__(self) -> FrameStream:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._done:
            error, self._error = self._error, None
            if error is not None:
                raise error
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        frames = []
        while True:
            if isinstance(item, tuple) and item and item[0] is _END:
                self._end(item[1])
                break
            frames.append(item)
            if self._queue.empty():
                break
            item = self._queue.get_nowait()
        if frames:
            return np.stack(frames)
        error, self._error = self._error, None
        if error is not None:
            raise error
        raise StopAsyncIteration

    def _end(self, outcome) -> None:
        self._done = True
        if isinstance(outcome, BaseException):
            self._error = outcome
            self.finish_reason = FinishReason.ERROR
        else:
            self.finish_reason = outcome

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            if self._on_close is not None:
                self._on_close(self.request_id)
