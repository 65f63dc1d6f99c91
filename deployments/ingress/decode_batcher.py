"""DecodeBatcher: an ingress replica's chunks from all its streams, sent to Code2Wav in few calls.

A Ray Serve request costs about a millisecond of CPU in each process it crosses. One request per chunk
left the Code2Wav replica handling requests rather than decoding once a few hundred streams were open (decode
calls waited while the GPU sat idle: docs/benchmarks.md). Here each stream's chunks (values or refs:
deployments/transport.py) join one queue, and a call to
`Code2Wav.decode_many` takes everything queued (up to `max_chunks`) as soon as one of `max_calls_in_flight`
call slots is free. An idle server sends a lone
chunk at once, so batching costs no latency; a busy one sends bigger calls, not more of them.

With a `StreamPlacement` (deployments/ingress/placement.py: a stateful Code2Wav of several replicas), each call
holds the chunks of streams whose state one replica holds and names that replica; a batch splits into one call
per replica it names (and one for the chunks going by load), sharing its call slot.

Any replica decodes any chunk and the chunks stay here (values, or refs this process owns), so a call whose replica
died (killed, OOM, node lost) is sent once more: Serve routes it to another (or the replacement) replica
and the streams whose decodes were on the dead one go on without a gap in their audio.

A call still unanswered after `CODE2WAV_CALL_PROBE_INTERVAL_S` checks that the Code2Wav deployment still
exists, and fails if it does not: Serve fails new calls to a deleted deployment at once, but calls already
waiting for a replica would wait forever (the app deleted while streams decode; a Talker's death reaches
its stream as an error chunk, which also goes through here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from ray.serve.handle import DeploymentHandle

from deployments import constants as C
from deployments.ingress.placement import Placement, StreamPlacement
from deployments.messages import TARGET_KWARG, DecodedChunk, talker_decoded
from stages.contract import SAMPLES_PER_FRAME, CodecChunk

logger = logging.getLogger("ray.serve")


class DecodeBatcher:
    def __init__(self, code2wav: DeploymentHandle, max_chunks: int, max_calls_in_flight: int,
                 max_answer_bytes: int | None = None, placement: StreamPlacement | None = None):
        """`code2wav`: the handle as the caller set its transport (deployments/transport.py `stage_handle`);
        `max_answer_bytes`: the PCM one call may return (the gRPC transport's message limit), None = no limit;
        `placement`: keep each stream's chunks on the replica holding its state (None: every call by load)."""
        self._handle = code2wav
        self._placement = placement
        self._max_chunks = max_chunks
        self._max_answer_bytes = max_answer_bytes
        self._slots = asyncio.Semaphore(max_calls_in_flight)
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._calls: set[asyncio.Task] = set()
        self.retries = 0  # calls sent again because their replica died
        self._tasks = [asyncio.get_running_loop().create_task(self._run())]

    def submit(self, chunk, stream: str | None = None, early: bool = False) -> asyncio.Future:
        """The decoded chunk, later. Cancelling the future drops the chunk if it has not left yet. A chunk that carries
        the Talker's own PCM (deployments/talker/first_chunk_decoder.py) is answered at once. `stream`: the request id
        of the chunk's stream (stream affinity; `forget` it when the stream ends); `early`: one of the stream's
        first chunks, which stream affinity never holds back (`StreamPlacement.place`)."""
        future: asyncio.Future[DecodedChunk] = asyncio.get_running_loop().create_future()
        decoded = talker_decoded(chunk) if isinstance(chunk, CodecChunk) else None
        if decoded is not None:  # the Talker sent its PCM along: nothing to decode
            future.set_result(decoded)
        else:
            self._enqueue(_Item(chunk, future, stream, early))
        return future

    def forget(self, stream: str) -> None:
        """The stream ended or its client left: no more of its chunks will come."""
        if self._placement is not None:
            for item in self._placement.forget(stream):
                item.future.cancel()

    def _enqueue(self, item: _Item) -> None:
        if self._placement is not None:
            placement = self._placement.place(item.stream, item, item.early)
            if placement is Placement.HOLD:
                return  # until the chunk placing its stream is answered (StreamPlacement.settle)
            item.placing = placement is Placement.LEAVE_AND_PLACE
        self._queue.put_nowait(item)

    async def _run(self) -> None:
        """Calls of the queued chunks, each taking what is queued; at most `max_calls_in_flight` in flight."""
        queue, slots = self._queue, self._slots
        carried = None  # the chunk that did not fit into the previous call's answer
        while True:
            await slots.acquire()
            batch = [carried or await queue.get()]
            carried, answer_bytes = None, _pcm_bytes(batch[0].chunk)
            while len(batch) < self._max_chunks and not queue.empty():
                item = queue.get_nowait()
                answer_bytes += _pcm_bytes(item.chunk)
                if self._max_answer_bytes is not None and answer_bytes > self._max_answer_bytes:
                    carried = item
                    break
                batch.append(item)
            for item in batch:  # streams that went away meanwhile: a dropped chunk that placed its stream
                if item.future.done():  # must not hold the stream's next chunks forever
                    self._settle(item, None)
            batch = [item for item in batch if not item.future.done()]
            if not batch:
                slots.release()
                continue
            call = asyncio.get_running_loop().create_task(self._calls_of(batch, slots))
            self._calls.add(call)
            call.add_done_callback(self._calls.discard)

    async def _calls_of(self, batch: list, slots: asyncio.Semaphore) -> None:
        """`batch` in one call, or with stream affinity one call per replica it names; then its slot is free."""
        try:
            if self._placement is None:
                await self._call(batch, None)
                return
            by_target: dict[str | None, list[_Item]] = {}
            for item in batch:
                by_target.setdefault(self._placement.target(item.stream), []).append(item)
            await asyncio.gather(*(self._call(items, target) for target, items in by_target.items()),
                                 return_exceptions=True)  # the slot is free only when every call of it ended
        finally:
            slots.release()

    async def _call(self, batch: list[_Item], target: str | None) -> None:
        try:
            answers = await self._decode([item.chunk for item in batch], target)
        except Exception as e:  # refused (backpressure) or failed: every chunk of the call fails with it
            answers = [e] * len(batch)
        if len(answers) != len(batch):  # never from Code2Wav; no future may wait forever for it
            answers = [RuntimeError(f"Code2Wav answered {len(answers)} of {len(batch)} chunks")] * len(batch)
        for item, answer in zip(batch, answers, strict=True):
            self._settle(item, answer)
            if item.future.done():
                continue
            if isinstance(answer, Exception):
                item.future.set_exception(answer)
            else:
                item.future.set_result(answer)

    def _settle(self, item: _Item, answer) -> None:
        """Stream affinity: where the item's stream has its state after `answer` (None: the item was dropped);
        the chunks held for it leave now if it placed the stream."""
        if self._placement is None or item.stream is None:
            return
        decoded = isinstance(answer, DecodedChunk)
        held = self._placement.settle(item.stream, answer.seq if decoded else -1,
                                      answer.replica if decoded else None, item.placing)
        for waiting in held:
            if not waiting.future.done():
                self._enqueue(waiting)

    async def _decode(self, chunks: list, target: str | None) -> list:
        from ray.exceptions import RayActorError

        try:
            return await self._answer(chunks, target)
        except RayActorError as e:  # the replica died with the call: any replica decodes it, so once more by load
            logger.warning(f"a Code2Wav replica died during a decode of {len(chunks)} chunks; retrying once "
                           f"({type(e).__name__})")
            self.retries += 1
            return await self._answer(chunks, None)

    async def _answer(self, chunks: list, target: str | None) -> list:
        """One decode_many call (naming `target`, the replica holding the chunks' streams, if any);
        DeploymentUnavailableError if Code2Wav is deleted while the call waits."""
        from ray.serve.exceptions import DeploymentUnavailableError

        if target is None:
            response = self._handle.decode_many.remote(chunks)
        else:
            response = self._handle.decode_many.remote(chunks, **{TARGET_KWARG: target})
        answer = asyncio.ensure_future(_result(response))
        try:
            while True:
                done, _ = await asyncio.wait({answer}, timeout=C.CODE2WAV_CALL_PROBE_INTERVAL_S)
                if done:
                    return answer.result()
                probe = self._handle.ready.remote()  # raises at once for a deleted deployment
                try:
                    await asyncio.wait_for(_result(probe), C.CODE2WAV_CALL_PROBE_INTERVAL_S)
                except DeploymentUnavailableError:
                    raise
                except Exception:  # a busy replica, or none yet (a replacement starts): it exists
                    probe.cancel()
        finally:
            if not answer.done():
                answer.cancel()
                response.cancel()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for call in list(self._calls):
            call.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass(eq=False)
class _Item:
    """A chunk waiting for its call: where its answer goes and how it is sent."""

    chunk: object  # a CodecChunk, or a ref to one (object_ref transport)
    future: asyncio.Future
    stream: str | None  # its stream's request id (stream affinity), None: unknown
    early: bool  # one of its stream's first chunks: never held (StreamPlacement)
    placing: bool = False  # its answer places its stream (StreamPlacement.LEAVE_AND_PLACE)


def _pcm_bytes(chunk) -> int:
    """The int16 PCM a chunk decodes to; 0 for a ref (its size is not known here, and refs are not limited)."""
    return chunk.num_new * SAMPLES_PER_FRAME * 2 if isinstance(chunk, CodecChunk) else 0


async def _result(response):
    return await response
