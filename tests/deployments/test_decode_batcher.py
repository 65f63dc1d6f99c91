"""DecodeBatcher: one Code2Wav call per batch of queued chunks, answers routed back to each stream."""

from __future__ import annotations

import asyncio

import pytest

from deployments.ingress.decode_batcher import DecodeBatcher
from tests.fake_response import FakeResponse


class _Ready:
    """`Code2Wav.ready`, the probe of a call that waits: raises once the deployment is deleted, else no answer
    (no replica: a replacement is starting)."""

    def __init__(self):
        self.deleted = False
        self.probes = 0

    def remote(self):
        self.probes += 1
        return FakeResponse(self._answer)

    async def _answer(self):
        from ray.serve._private.common import DeploymentID
        from ray.serve.exceptions import DeploymentUnavailableError

        if self.deleted:
            raise DeploymentUnavailableError(DeploymentID(name="Code2Wav", app_name="tts"))
        await asyncio.Event().wait()


class _Code2Wav:
    """Stands in for the Code2Wav handle: records each call's chunks; the test releases calls one by one."""

    def __init__(self):
        self.calls: list[list] = []
        self.responses: list[FakeResponse] = []
        self.release: asyncio.Queue = asyncio.Queue()
        self.decode_many = self
        self.ready = _Ready()

    def remote(self, chunks: list):
        self.calls.append(list(chunks))
        self.responses.append(FakeResponse(lambda: self._answer(list(chunks))))
        return self.responses[-1]

    async def _answer(self, chunks: list):
        outcome = await self.release.get()
        if isinstance(outcome, Exception):
            raise outcome
        return [ValueError(f"bad {c}") if c == "bad" else f"pcm:{c}" for c in chunks]


def test_lone_chunk_goes_at_once_and_busy_chunks_share_a_call():
    async def main():
        handle = _Code2Wav()
        batcher = DecodeBatcher(handle, max_chunks=3, max_calls_in_flight=1)
        first = batcher.submit("a")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert handle.calls == [["a"]]  # nothing waited for company
        rest = [batcher.submit(x) for x in "bcde"]  # arrive while the only call slot is busy
        handle.release.put_nowait("ok")
        assert await first == "pcm:a"
        handle.release.put_nowait("ok")
        assert [await f for f in rest[:3]] == ["pcm:b", "pcm:c", "pcm:d"]
        handle.release.put_nowait("ok")
        assert await rest[3] == "pcm:e"
        assert handle.calls == [["a"], ["b", "c", "d"], ["e"]]  # max_chunks per call
        await batcher.close()

    asyncio.run(main())


def test_a_call_answers_at_most_max_answer_bytes_of_pcm():
    """The gRPC transport's message limit: chunks that would overflow one answer go in the next call."""
    import numpy as np

    from stages.contract import SAMPLES_PER_FRAME, CodecChunk

    def chunk(seq: int, frames: int) -> CodecChunk:
        return CodecChunk("r", seq, np.zeros((frames, 16), dtype=np.int64), 0)

    async def main():
        handle = _Code2Wav()
        frame_bytes = SAMPLES_PER_FRAME * 2
        batcher = DecodeBatcher(handle, max_chunks=8, max_calls_in_flight=1, max_answer_bytes=10 * frame_bytes)
        blocker = batcher.submit(chunk(0, 1))
        await asyncio.sleep(0)
        rest = [batcher.submit(chunk(seq, 4)) for seq in range(1, 5)]  # 16 frames: two calls of 8
        for _ in range(3):
            handle.release.put_nowait("ok")
        await asyncio.gather(blocker, *rest)
        assert [[c.seq for c in call] for call in handle.calls] == [[0], [1, 2], [3, 4]]
        await batcher.close()

    asyncio.run(main())


def test_errors_reach_their_own_chunks_and_cancelled_chunks_are_not_sent():
    async def main():
        handle = _Code2Wav()
        batcher = DecodeBatcher(handle, max_chunks=8, max_calls_in_flight=1)
        blocker = batcher.submit("x")
        await asyncio.sleep(0)
        good, bad, gone = batcher.submit("g"), batcher.submit("bad"), batcher.submit("gone")
        gone.cancel()  # its stream closed before the chunk left
        handle.release.put_nowait("ok")
        await blocker
        handle.release.put_nowait("ok")
        assert await good == "pcm:g"
        with pytest.raises(ValueError, match="bad bad"):
            await bad
        assert handle.calls[1] == ["g", "bad"]
        failing = [batcher.submit("p"), batcher.submit("q")]
        handle.release.put_nowait(RuntimeError("refused"))
        for f in failing:  # a refused call fails every chunk it carried
            with pytest.raises(RuntimeError, match="refused"):
                await f
        await batcher.close()

    asyncio.run(main())


def test_a_call_whose_replica_died_is_sent_once_more():
    from ray.exceptions import ActorDiedError

    async def main():
        handle = _Code2Wav()
        batcher = DecodeBatcher(handle, max_chunks=8, max_calls_in_flight=1)
        first = batcher.submit("a")
        await asyncio.sleep(0)
        handle.release.put_nowait(ActorDiedError())  # the replica died with the call
        handle.release.put_nowait("ok")
        assert await first == "pcm:a"
        assert handle.calls == [["a"], ["a"]] and batcher.retries == 1
        second = batcher.submit("b")  # twice in a row: the stream sees the error (no endless retries)
        handle.release.put_nowait(ActorDiedError())
        handle.release.put_nowait(ActorDiedError())
        with pytest.raises(ActorDiedError):
            await second
        other = batcher.submit("c")  # an error that is not a dead replica is not retried
        handle.release.put_nowait(RuntimeError("decode failed"))
        with pytest.raises(RuntimeError):
            await other
        assert handle.calls[2:] == [["b"], ["b"], ["c"]]
        await batcher.close()

    asyncio.run(main())


def test_a_call_that_waits_fails_once_code2wav_is_deleted(monkeypatch):
    """Serve leaves a call that waits for a replica waiting forever once its deployment is deleted (the app
    deleted while streams decode); new calls to it fail at once, which the batcher's probe sees."""
    from ray.serve.exceptions import DeploymentUnavailableError

    from deployments import constants as C

    monkeypatch.setattr(C, "CODE2WAV_CALL_PROBE_INTERVAL_S", 0.02)

    async def main():
        handle = _Code2Wav()
        batcher = DecodeBatcher(handle, max_chunks=8, max_calls_in_flight=1)
        slow = batcher.submit("a")  # no answer for several probe intervals: the deployment exists, it waits
        while handle.ready.probes < 3:
            await asyncio.sleep(0.01)
        handle.release.put_nowait("ok")
        assert await slow == "pcm:a"
        stuck = batcher.submit("b")
        while handle.ready.probes < 4:
            await asyncio.sleep(0.01)
        handle.ready.deleted = True
        with pytest.raises(DeploymentUnavailableError):
            await stuck
        assert handle.responses[-1].cancelled  # the call that waited is given up, not left queued
        queued = batcher.submit("c")  # the call slot is free again: later chunks fail too, rather than wait
        with pytest.raises(DeploymentUnavailableError):
            await queued
        await batcher.close()

    asyncio.run(main())
