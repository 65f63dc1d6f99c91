"""Stream affinity: the ingress keeps each stream's chunks on the Code2Wav replica holding its state."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import numpy as np
import pytest

from deployments.code2wav.router import StreamAffinityRouter
from deployments.config import TTSServingArgs
from deployments.ingress.decode_batcher import DecodeBatcher
from deployments.ingress.placement import Placement, StreamPlacement
from deployments.messages import DecodedChunk
from stages.contract import CodecChunk
from tests.fake_response import FakeResponse


def _chunk(stream: str, seq: int, final: bool = False) -> CodecChunk:
    return CodecChunk(stream, seq, np.zeros((2, 16), dtype=np.int64), 0, final=final)


class _Replicas:
    """Stands in for the Code2Wav handle and its router: a call naming a replica goes there unless the test made
    it `full`; the others go to the replicas in turn. Each answer names the replica that decoded it."""

    def __init__(self, names=("A", "B")):
        self.names, self.full = list(names), set()
        self.calls: list[tuple[str | None, str, list[tuple[str, int]]]] = []  # (named, went to, chunks)
        self.failing: set[str] = set()  # streams whose next call fails
        self._turn = 0
        self.decode_many = self

    def remote(self, chunks: list, replica: str | None = None):
        if replica is not None and replica not in self.full:
            went = replica
        else:
            free = [n for n in self.names if n not in self.full]
            went = free[self._turn % len(free)]
            self._turn += 1
        self.calls.append((replica, went, [(c.request_id, c.seq) for c in chunks]))
        fail = any(c.request_id in self.failing for c in chunks)
        self.failing -= {c.request_id for c in chunks}

        async def answer():
            if fail:
                raise RuntimeError("replica refused the call")
            return [DecodedChunk(c.request_id, c.seq, np.zeros(4, np.int16), c.final, None, (), went) for c in chunks]
        return FakeResponse(answer)

    def went(self, stream: str) -> list[tuple[str | None, str]]:
        """(named, decoded on) of each of the stream's chunks, in seq order."""
        out = [(named, went, seq) for named, went, chunks in self.calls for rid, seq in chunks if rid == stream]
        return [(named, went) for named, went, _ in sorted(out, key=lambda x: x[2])]


class _Gated(_Replicas):
    """Calls are answered only once the test opens the gate."""

    def __init__(self):
        super().__init__()
        self.gate = asyncio.Event()

    def remote(self, chunks, replica=None):
        response = super().remote(chunks, replica)

        async def later():
            await self.gate.wait()
            return await response
        return FakeResponse(later)


def test_a_streams_later_chunks_wait_for_its_first_answer_then_follow_its_replica():
    async def main():
        replicas = _Replicas()
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=2, placement=StreamPlacement())
        futures = {s: [batcher.submit(_chunk(s, k, final=k == 3), stream=s) for k in range(4)] for s in "xyz"}
        for fs in futures.values():
            assert [(await f).seq for f in fs] == [0, 1, 2, 3]
        for s in "xyz":
            went = replicas.went(s)
            first = went[0][1]
            assert went[0][0] is None  # the first goes by load
            assert went[1:] == [(first, first)] * 3  # every later one names the first's replica and lands there
        await batcher.close()

    asyncio.run(main())


def test_a_chunk_the_router_sends_elsewhere_moves_the_stream_there():
    async def main():
        replicas = _Replicas()
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=1, placement=StreamPlacement())
        assert (await batcher.submit(_chunk("s", 0), stream="s")).replica == "A"
        replicas.full.add("A")  # A refuses work: the named call goes by load, to B, which now holds the state
        assert (await batcher.submit(_chunk("s", 1), stream="s")).replica == "B"
        replicas.full.clear()
        assert (await batcher.submit(_chunk("s", 2), stream="s")).replica == "B"
        assert replicas.went("s") == [(None, "A"), ("A", "B"), ("B", "B")]
        await batcher.close()

    asyncio.run(main())


def test_a_failed_first_decode_places_the_stream_again_and_releases_its_held_chunks():
    async def main():
        replicas = _Replicas()
        replicas.failing.add("s")
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=1, placement=StreamPlacement())
        first, second, third = (batcher.submit(_chunk("s", k), stream="s") for k in range(3))
        with pytest.raises(RuntimeError):
            await first
        assert (await second).seq == 1 and (await third).seq == 2
        went = replicas.went("s")
        assert went[1][0] is None  # placed again by load after the failure
        assert went[2] == (went[1][1], went[1][1])  # then followed
        await batcher.close()

    asyncio.run(main())


def test_forgetting_a_stream_cancels_its_held_chunks_and_drops_its_entry():
    async def main():
        replicas = _Gated()
        placement = StreamPlacement()
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=1, placement=placement)
        first = batcher.submit(_chunk("s", 0), stream="s")
        held = batcher.submit(_chunk("s", 1), stream="s")
        while not replicas.calls:
            await asyncio.sleep(0)
        batcher.forget("s")  # the client left while the chunk placing its stream was out
        assert held.cancelled() and len(placement) == 0
        replicas.gate.set()
        await first  # the late answer does not bring the stream back
        assert len(placement) == 0
        await batcher.close()

    asyncio.run(main())


def test_without_placement_calls_name_no_replica():
    async def main():
        replicas = _Replicas()
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=1)
        for k in range(3):
            await batcher.submit(_chunk("s", k), stream="s")
        assert [named for named, _ in replicas.went("s")] == [None, None, None]
        await batcher.close()

    asyncio.run(main())


def _args(stateful: bool, deployment: dict, choice: str = "auto", **decode_batch) -> TTSServingArgs:
    return TTSServingArgs.model_validate({
        "models": [{"name": "m"}],
        "code2wav": {"engine_kwargs": {"stateful": stateful}, "deployment_config": deployment},
        "ingress": {"decode_batch": {"stream_affinity": choice, **decode_batch}}})


@pytest.mark.parametrize("stateful, deployment, choice, expected", [
    (True, {"num_replicas": 2}, "auto", True),
    (True, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}, "auto", True),
    (True, {"num_replicas": "auto"}, "auto", True),
    (True, {}, "auto", False),  # one replica holds every stream anyway
    (True, {}, "on", True),
    (False, {"num_replicas": 2}, "auto", False),  # no state to follow
    (False, {"num_replicas": 2}, "on", False),
    (True, {"num_replicas": 2}, "off", False),
    (True, {"num_replicas": 2}, False, False),  # `stream_affinity: off` in a YAML file reads as false
    (True, {}, True, True),
])
def test_affinity_is_on_for_a_stateful_code2wav_of_several_replicas(stateful, deployment, choice, expected):
    from deployments.builder import code2wav_deployment_options

    args = _args(stateful, deployment, choice)
    assert args.stream_affinity is expected
    # and only then does Code2Wav route by the affinity router (off: Serve's own, the fair baseline)
    options = code2wav_deployment_options(args.code2wav, args.stream_affinity)
    assert ("request_router_config" in options) is expected


def _replica(name: str):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))


def _request(**kwargs):
    """A pending decode_many call as the router sees it (`replica=`: the replica it names)."""
    return SimpleNamespace(kwargs=kwargs, routing_context=SimpleNamespace(should_backoff=False))


def test_the_router_ranks_the_named_replica_first_and_two_others_after_it():
    router = StreamAffinityRouter.__new__(StreamAffinityRouter)  # choose_replicas reads none of its state
    replicas = [_replica(n) for n in "ABCD"]
    named = _request(replica="C")
    ranks = asyncio.run(router.choose_replicas(replicas, named))
    assert [r.replica_id.unique_id for r in ranks[0]] == ["C"]
    assert len(ranks[1]) == 2 and all(r.replica_id.unique_id != "C" for r in ranks[1])
    # every rank was offered: if none accepts, Serve backs off before asking again (else it spins on full replicas)
    assert named.routing_context.should_backoff
    gone = asyncio.run(router.choose_replicas(replicas, _request(replica="Z")))
    assert len(gone) == 1 and len(gone[0]) == 2  # a replica that is gone: by load
    unnamed = _request()
    assert [len(rank) for rank in asyncio.run(router.choose_replicas(replicas, unnamed))] == [2]
    assert unnamed.routing_context.should_backoff
    assert asyncio.run(router.choose_replicas([], _request(replica="C"))) == []


def test_the_router_offers_two_replicas_in_either_order():
    """Serve takes the first of a rank's replicas when their queues tie: with two replicas in list order, every
    unnamed call between idle replicas went to the first (a stream's placement, and stats calls that never reached
    the second)."""
    router = StreamAffinityRouter.__new__(StreamAffinityRouter)
    pair = [_replica("A"), _replica("B")]
    rng_state = random.getstate()
    random.seed(11)
    try:
        firsts = {asyncio.run(router.choose_replicas(pair, _request()))[0][0].replica_id.unique_id for _ in range(32)}
    finally:
        random.setstate(rng_state)
    assert firsts == {"A", "B"}


def test_a_placing_chunk_dropped_before_it_left_does_not_hold_the_next_ones():
    async def main():
        replicas = _Gated()
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=1, placement=StreamPlacement())
        busy = batcher.submit(_chunk("other", 0), stream="other")
        while not replicas.calls:  # its call is out and holds the only call slot
            await asyncio.sleep(0)
        first = batcher.submit(_chunk("s", 0), stream="s")  # queued behind the slot: the stream's placing chunk
        second = batcher.submit(_chunk("s", 1), stream="s")  # held behind it
        first.cancel()  # dropped before it left (its future cancelled by whoever waited for it)
        replicas.gate.set()
        await busy
        # placed the stream in its stead (the bound only turns a hang into a failure)
        assert (await asyncio.wait_for(second, 30)).seq == 1
        assert [chunks for _, _, chunks in replicas.calls] == [[("other", 0)], [("s", 1)]]
        await batcher.close()

    asyncio.run(main())


def test_a_streams_early_chunks_are_never_held():
    async def main():
        replicas = _Gated()
        placement = StreamPlacement()
        batcher = DecodeBatcher(replicas, max_chunks=16, max_calls_in_flight=4, placement=placement)
        early = [batcher.submit(_chunk("s", k), stream="s", early=True) for k in range(2)]
        placing = batcher.submit(_chunk("s", 2), stream="s")
        held = batcher.submit(_chunk("s", 3), stream="s")
        while sum(len(c) for _, _, c in replicas.calls) < 3:  # the early ones and the placing one leave at once
            await asyncio.sleep(0)
        assert sorted(seq for _, _, c in replicas.calls for _, seq in c) == [0, 1, 2]
        replicas.gate.set()
        assert [(await f).seq for f in (*early, placing, held)] == [0, 1, 2, 3]
        went = replicas.went("s")
        assert went[3] == (went[2][1], went[2][1])  # the held one follows the placing one's replica
        await batcher.close()

    asyncio.run(main())


def test_placement_places_once_and_follows_the_latest_answer():
    placement = StreamPlacement()
    assert placement.place("s", "c0", early=True) is Placement.LEAVE
    assert placement.place("s", "c2") is Placement.LEAVE_AND_PLACE
    assert placement.place("s", "c3") is Placement.HOLD
    assert placement.settle("s", 0, "A") == []  # an early chunk's answer names a replica, releases nothing
    assert placement.target("s") == "A"
    assert placement.settle("s", 2, "B", placing=True) == ["c3"]
    assert placement.target("s") == "B"
    assert placement.settle("s", 1, "A") == [] and placement.target("s") == "B"  # an older answer: no move
    assert placement.place("s", "c4") is Placement.LEAVE
    assert placement.forget("s") == [] and len(placement) == 0
    assert placement.settle("s", 5, "A") == [] and len(placement) == 0  # a late answer: nothing comes back


def test_by_load_a_streams_two_early_chunks_may_start_two_states():
    """By load, a stream's two early chunks (neither waits for the other's answer) may start two states."""
    async def main():
        replicas = _Replicas(("A", "B"))
        batcher = DecodeBatcher(replicas, max_chunks=1, max_calls_in_flight=4, placement=StreamPlacement())
        await asyncio.gather(*(batcher.submit(_chunk("s", k), stream="s", early=True) for k in range(2)))
        assert replicas.went("s") == [(None, "A"), (None, "B")]
        await batcher.close()

    asyncio.run(main())


def test_the_ingress_places_streams_only_with_affinity():
    from deployments.ingress.server import TTSIngress

    by_load = TTSIngress._placement(_args(True, {"num_replicas": 2}))
    by_load.settle("w", 0, "A")  # an answer of an unknown stream places nothing...
    by_load.place("s", "c0", early=True)
    assert by_load.target("s") is None  # ...and a new stream goes by load until its own answer names a replica
    assert TTSIngress._placement(_args(False, {"num_replicas": 2})) is None  # no state, no placement
