"""ChunkStream: the codec chunks of one request, handed from the engine thread to an asyncio consumer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from stages.contract import CodecChunk, FinishReason

_END = object()


class ChunkStream:
    """Async iterator of one request's `CodecChunk`s (left context included), in order.

    The engine cuts chunks where the frames are (its loop), so a consumer is woken once per chunk, not
    once per frame. The last chunk has `final=True` and the finish reason; `finish_reason` is also set on
    the stream when it ends. An engine error ends the stream by raising it. Closing the stream early
    (`aclose()`, or cancelling the consumer) aborts the request in the engine.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_close: Callable[[str], None] | None = None):
        self.request_id = request_id
        self.finish_reason: FinishReason | None = None
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._on_close = on_close
        self.on_end: Callable[[str], None] | None = None  # called on the consumer's loop when the end arrives
        self._done = False

    # engine-thread side -------------------------------------------------
    @staticmethod
    def deliver_many(items: list[tuple[ChunkStream, list]]) -> None:
        """Hand one step's chunks (and ends) to their loops: one callback per event loop, not per stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, entries in items:
            by_loop.setdefault(stream._loop, []).append((stream, entries))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(ChunkStream._put_all, batch)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    @staticmethod
    def _put_all(batch: list) -> None:
        for stream, entries in batch:
            for entry in entries:
                stream._queue.put_nowait(entry)
                if stream.on_end is not None and isinstance(entry, tuple) and entry and entry[0] is _END:
                    stream.on_end(stream.request_id)

    @staticmethod
    def end(reason: FinishReason | BaseException) -> tuple:
        """The entry that ends a stream (after its chunks): a finish reason or an error."""
        return (_END, reason)

    def fail(self, error: BaseException) -> None:
        ChunkStream.deliver_many([(self, [ChunkStream.end(error)])])

    # consumer side ----------------------------------------------------------
    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> CodecChunk:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if isinstance(item, tuple) and item and item[0] is _END:
            self._done = True
            outcome = item[1]
            if isinstance(outcome, BaseException):
                self.finish_reason = FinishReason.ERROR
                raise outcome
            self.finish_reason = outcome
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            if self._on_close is not None:
                self._on_close(self.request_id)
