"""One ingress replica's share of the batch jobs: it claims items from the store, synthesizes each as a
low-priority Talker request, and writes its audio to disk.

Memory stays bounded: at most `ingress.batch.items_in_flight` items per replica, each streamed chunk by chunk
through its format's encoder into its result file (never a whole clip in memory). Every replica of every
deployment of the app runs one; they share the store, and its leases keep two of them off the same item. A
replica that starts resumes whatever is queued, and whatever a stopped replica left running once its lease runs
out; a replica stopped gracefully (`serve deploy`, scale-down) gives its items back at once.

What becomes of an item:
- its audio is whole on disk and its claim still holds: `completed`;
- the request fails as `/v1/audio/speech` would answer it (400, 404, 500, 504): `failed`, with that error;
- the app is at capacity or a model is unavailable (429, 503), or the store cannot be written (disk full,
  storage unreachable): back to the queue, and this replica claims nothing for a while;
- its job is cancelled: its Talker request is aborted at the next lease renewal, its partial file removed.

An item's deadline (its `timeout_s`, at most `ingress.request_timeout_s`) runs from its first audio: the wait for
capacity real-time work leaves idle is what a batch item is for, and does not count.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from deployments import constants as C
from deployments.audio.encoders import FileEncoder
from deployments.config import BatchSettings
from deployments.errors import to_api_error
from deployments.ingress.batch_store import BatchStore, Claim, StoreUnavailable
from deployments.ingress.schemas import SpeechRequest
from deployments.messages import DecodedChunk

logger = logging.getLogger("ray.serve")

# (body, request id) -> the request's decoded chunks: validated, routed and started as a batch-priority request
Synthesize = Callable[[SpeechRequest, str], Awaitable[AsyncIterator[DecodedChunk]]]
RETRYABLE = (429, 503)  # the app is busy or a model is unavailable: the item waits, it did not fail
SWEEP_INTERVAL_S = 3600.0  # how often a replica deletes jobs past their retention


class BatchWorker:
    def __init__(self, store: BatchStore, settings: BatchSettings, synthesize: Synthesize, request_timeout_s: float,
                 on_counts: Callable[[dict[str, int]], None] | None = None, owner: str | None = None):
        self.store, self.settings = store, settings
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._synthesize, self._timeout_s, self._on_counts = synthesize, request_timeout_s, on_counts
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        self._wake = asyncio.Event()
        self._main: asyncio.Task | None = None
        self._closed = False
        self._paused_until = 0.0  # loop time before which nothing new is claimed (busy app, full disk)
        self._renewed = self._swept = self._counted = float("-inf")
        self._last_warning = ""

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def start(self) -> None:
        self._main = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        """Look for work now (a job was just submitted here)."""
        self._wake.set()

    def stop_job(self, job_id: str) -> None:
        """The job was cancelled: stop its items here now (the store no longer counts them as running)."""
        for (job, _index), task in self._tasks.items():
            if job == job_id:
                task.cancel()

    def close(self) -> None:
        """Stop (the replica shuts down): running items are aborted and given back to the queue at once, so another
        replica resumes them without waiting for their leases to run out."""
        if self._main is None or self._closed:
            return  # never started, or closed already
        self._closed = True
        self._main.cancel()
        for task in self._tasks.values():
            task.cancel()
        try:
            self.store.release(self.owner)
        except StoreUnavailable as exc:  # their leases run out instead
            logger.warning(f"batch: could not give back {len(self._tasks)} items on stop: {exc}")
        self.store.close()

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            try:
                await self._tick(loop.time())
            except StoreUnavailable as exc:
                self._warn(f"batch: {exc}; retrying")
                self._paused_until = loop.time() + C.BATCH_POLL_INTERVAL_S
            except Exception:  # never let the loop die: the next tick tries again
                logger.exception("batch: worker iteration failed")
            try:
                async with asyncio.timeout(min(C.BATCH_POLL_INTERVAL_S, self.settings.lease_s / 3)):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _tick(self, now: float) -> None:
        if self._tasks and now - self._renewed >= self.settings.lease_s / 3:
            held = await asyncio.to_thread(self.store.renew, self.owner, list(self._tasks))
            self._renewed = now
            for key, task in list(self._tasks.items()):
                if key not in held:  # cancelled (or taken over after a lapse): stop generating it
                    task.cancel()
        free = self.settings.items_in_flight - len(self._tasks)
        if free > 0 and now >= self._paused_until:
            for claim in await asyncio.to_thread(self.store.claim, self.owner, free):
                task = asyncio.get_running_loop().create_task(self._item(claim))
                self._tasks[claim.key] = task
                task.add_done_callback(lambda _t, key=claim.key: self._done(key))
        if now - self._swept >= SWEEP_INTERVAL_S:
            self._swept = now
            if expired := await asyncio.to_thread(self.store.expire, self.settings.retention_s):
                logger.info(f"batch: deleted {expired} jobs past their retention")
        if self._on_counts is not None and now - self._counted >= C.METRICS_REFRESH_INTERVAL_S:
            self._counted = now
            self._on_counts(await asyncio.to_thread(self.store.counts))

    def _done(self, key: tuple[str, int]) -> None:
        self._tasks.pop(key, None)
        self._wake.set()  # a slot is free

    def _pause(self, seconds: float) -> None:
        self._paused_until = max(self._paused_until, asyncio.get_running_loop().time() + seconds)

    def _warn(self, message: str) -> None:
        if message != self._last_warning:  # one line per distinct trouble, not one per poll
            self._last_warning = message
            logger.warning(message)

    # ------------------------------------------------------------------ one item
    async def _item(self, claim: Claim) -> None:
        started = time.perf_counter()
        try:
            body = SpeechRequest.model_validate_json(claim.body)
            name, size = await self._write(claim, body)
            if await asyncio.to_thread(self.store.complete, self.owner, claim, name, size):
                logger.info(f"batch {claim.job_id}[{claim.index}]: {size} bytes in "
                            f"{time.perf_counter() - started:.1f} s")
            self._last_warning = ""
        except asyncio.CancelledError:
            raise  # cancelled job or stopping replica: the store already says what became of the item
        except StoreUnavailable as exc:
            self._warn(f"batch {claim.job_id}[{claim.index}]: {exc}; the item waits")
            self._pause(C.BATCH_POLL_INTERVAL_S)
            await self._give_back(claim)
        except Exception as exc:
            error = to_api_error(exc)
            if error.status in RETRYABLE:
                self._pause(error.retry_after_s or C.DEFAULT_RETRY_AFTER_S)
                await self._give_back(claim)
                return
            logger.info(f"batch {claim.job_id}[{claim.index}]: {error.status} {error.code}: {error.message[:200]}")
            try:
                await asyncio.to_thread(self.store.fail, self.owner, claim, error.status, error.body())
            except StoreUnavailable as store_exc:  # its lease runs out and it is tried again
                self._warn(f"batch {claim.job_id}[{claim.index}]: {store_exc}")

    async def _give_back(self, claim: Claim) -> None:
        try:
            await asyncio.to_thread(self.store.release, self.owner, [claim.key])
        except StoreUnavailable:
            pass  # its lease runs out instead

    async def _write(self, claim: Claim, body: SpeechRequest) -> tuple[str, int]:
        """The item's audio into its result file, chunk by chunk; -> (file name, bytes) once it is whole on disk."""
        request_id = f"batch-{claim.job_id.removeprefix('batch_')}-{claim.index}-{uuid.uuid4().hex[:8]}"
        timeout_s = min(body.timeout_s or self._timeout_s, self._timeout_s)
        chunks = await self._synthesize(body, request_id)
        try:
            with self.store.result_file(claim, body.response_format) as file:
                encoder = FileEncoder(body.response_format, file, body.speed)
                try:
                    async with asyncio.timeout(None) as deadline:
                        async for chunk in chunks:
                            if deadline.when() is None:  # the first audio: the wait for capacity is over
                                deadline.reschedule(asyncio.get_running_loop().time() + timeout_s)
                            await asyncio.to_thread(encoder.push, chunk.pcm)
                    await asyncio.to_thread(encoder.finish)
                except BaseException:
                    encoder.abandon()
                    if file.failure is not None:  # the disk, not the request (an encoder may wrap the OSError)
                        raise file.failure from None
                    raise
                await asyncio.to_thread(file.commit)
                return file.name, file.size
        finally:
            await chunks.aclose()
