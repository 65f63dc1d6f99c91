"""Coalescer: work that arrives while a batch runs waits for the next batch, in a replica's event loop.

One drainer task takes everything waiting and runs it as one batch (at most `max_batch` items per batch). With `hold`,
a batch that the policy finds too small waits for more items, up to the time `hold` names, and leaves as soon as
an arrival makes it big enough (fewer, larger batches where every item has time to spare). A failed batch
fails only its own items. Each submitter's future is shielded: a caller that leaves does not cancel the batch
the others share. Used by Code2Wav (the calls of several ingress replicas) and the Talker's first-chunk decoder.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(self, run: Callable[[list[T]], Awaitable[list[R]]], max_batch: int | None = None,
                 hold: Callable[[list[T]], float] | None = None):
        """`run`: one batch -> one result per item (raises to fail the batch). `hold`: the items waiting -> seconds
        the next batch may still wait for more (0: run it now); asked again at each arrival, the wait counted from
        the first time it was asked for that batch."""
        self._run, self._max_batch, self._hold = run, max_batch, hold
        self.waiting: list[tuple[T, asyncio.Future]] = []  # items (and their answers' futures) for the next batch
        self._drainer: asyncio.Task | None = None
        self._arrived = asyncio.Event()  # set by every submit: a holding batch looks again
        self.held = 0  # batches that waited for more items (metrics, tests)

    async def submit(self, item: T) -> R:
        """`item`'s result, once a batch holding it has run."""
        return await asyncio.shield(self.submit_nowait(item))

    def submit_nowait(self, item: T) -> asyncio.Future[R]:
        """`submit` without waiting: the future of `item`'s result (or of the failure of its batch)."""
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((item, future))
        self._arrived.set()
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return future

    async def _fill(self) -> None:
        """Wait while `hold` asks for more items (an arrival, or its time running out, ends each wait)."""
        if self._hold is None or (wait := self._hold([item for item, _ in self.waiting])) <= 0:
            return
        self.held += 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while (left := deadline - loop.time()) > 0 and self._hold([item for item, _ in self.waiting]) > 0:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                return

    async def _drain(self) -> None:
        while self.waiting:
            await self._fill()
            taken, self.waiting = self.waiting, []
            for batch in self._batches(taken):
                try:
                    results = await self._run([item for item, _ in batch])
                except Exception as e:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    if not future.done():
                        future.set_result(result)

    def _batches(self, taken: list[tuple[T, asyncio.Future]]) -> list[list[tuple[T, asyncio.Future]]]:
        if self._max_batch is None:
            return [taken]
        return [taken[i:i + self._max_batch] for i in range(0, len(taken), self._max_batch)]


def ignore_failure(future: asyncio.Future) -> None:
    """A done callback for a future nobody awaits: its exception is retrieved (asyncio would log it as lost)."""
    if not future.cancelled():
        future.exception()
