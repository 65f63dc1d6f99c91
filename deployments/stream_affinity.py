"""Stream affinity: a stream's Code2Wav decodes go to the replica that holds its decoder state.

A stateful Code2Wav replica (docs/code2wav.md section 6) decodes only a chunk's new frames when it holds the
stream's state; any other replica decodes the chunk over its left context: correct, but about twice the work at
the serving defaults (25 frames of context for a 25-frame chunk). Serve routes each call by load, so with N
Code2Wav replicas (N - 1) / N of a stream's later chunks landed on a replica without its state (replicas.yaml
on 4 GPUs: 3 in 4).

Two halves, one in each process:
- `StreamPlacement` (the ingress's DecodeBatcher, no Ray): which replica decoded each stream's latest chunk
  (`DecodedChunk.replica`), so the next call of that stream names it. While the chunk that places a stream is out,
  the stream's next chunks wait for its answer instead of going wherever the load sends them: they would start a
  second state on another replica (a stream's first two chunks never wait: their listener does).
- `StreamAffinityRouter` (Serve's public request-router interface, set as the Code2Wav deployment's
  `request_router_config` where affinity is on): a call that names a replica (`decode_many(chunks, replica=...)`)
  goes to it while it accepts work (fewer than its `max_ongoing_requests` calls: it is not otherwise load-aware);
  when it is full or gone, the call goes by load like any other (power of two choices on queue
  length), and its chunks decode over their left context there; the answer says where the state now is.

Where a new stream goes (`StreamPlacement(spread_new_streams=...)`, config `ingress.decode_batch.place_new_streams`):
by default its chunks go by load until an answer names a replica, and the stream's state is where they land. The
first two are never held (their listener waits for them), so a second chunk that leaves before the first is
answered starts a second state on another replica: on 4 replicas 1.62 fresh chunks per request against 1.0 on one
(H100, 2026-11-28). With `spread_new_streams` the ingress names a replica from a stream's first chunk on: of the replicas
that have answered it, the one holding the fewest of its streams (the slots a stateful replica keeps are bounded).
The ingress learns replicas only from answers, and a replica that no call reaches never answers: so every
`explore_every`-th new stream still goes by load, which finds the replicas this ingress has not heard from (one
added by autoscaling, or skipped after a miss). Without it, the first replica to answer took every later stream
(a served CPU run with two Code2Wav replicas, 2026-11-28: 186 chunks on one, none from the ingress on the other).
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# with spread_new_streams, one new stream in this many goes by load: the only way an ingress hears of a replica
# that none of its calls reaches (on 4 replicas a stream placed by load starts ~1.6 states, so 1 in 8: ~+0.08)
EXPLORE_EVERY = 8
TARGET_KWARG = "replica"  # decode_many's keyword argument that names the replica holding the chunks' streams


class Placement(enum.Enum):
    """What `StreamPlacement.place` says of a chunk."""

    LEAVE = 1  # send it now, naming `target(stream)` (None: by load)
    LEAVE_AND_PLACE = 2  # send it now by load; its answer places the stream (`settle(..., placing=True)`)
    HOLD = 3  # held until the chunk placing its stream is answered


@dataclass
class _Stream:
    holder: str | None = None  # the replica that answered the stream's latest chunk
    latest: int = -1  # that chunk's seq
    placing: bool = False  # a chunk that places the stream is out
    held: list[Any] = field(default_factory=list)  # items waiting for it


class StreamPlacement:
    """Per stream: where its Code2Wav state is. Entries live from a stream's first chunk to `forget`.

    A stream's early chunks (its first two, or its urgent ones: a listener waits for them, and the second must
    follow within the first's audio) are never held: they leave at once, by load until an answer names a replica.
    The first later chunk that finds no replica named places the stream, and the ones after it wait for its answer.
    """

    def __init__(self, spread_new_streams: bool = False, explore_every: int = EXPLORE_EVERY):
        """`spread_new_streams`: a new stream's first chunk names the answering replica with the fewest of these
        streams (until one has answered, and for every `explore_every`-th new stream, by load as without)."""
        if explore_every < 2:
            raise ValueError(f"explore_every must be >= 2 (every new stream by load is spread_new_streams=False), "
                             f"got {explore_every}")
        self._streams: dict[str, _Stream] = {}
        self._spread = spread_new_streams
        self._explore_every = explore_every
        self._new_streams = 0  # new streams placed while spreading (counts toward the next one by load)
        self._answering: set[str] = set()  # replicas that answered, less any that missed a call naming it since

    def __len__(self) -> int:
        return len(self._streams)

    def place(self, stream: str | None, item: Any, early: bool = False) -> Placement:
        """What to do with `item`, a chunk of `stream`; a held one comes back from `settle`."""
        if stream is None:
            return Placement.LEAVE
        state = self._streams.get(stream)
        if state is None:
            state = self._streams[stream] = _Stream()
            if self._spread and self._answering:
                self._new_streams += 1
                if self._new_streams % self._explore_every:  # else by load: it may find a replica not yet heard from
                    state.holder = self._fewest_streams()
        if state.holder is not None or early:
            return Placement.LEAVE
        if state.placing:
            state.held.append(item)
            return Placement.HOLD
        state.placing = True
        return Placement.LEAVE_AND_PLACE

    def settle(self, stream: str, seq: int, replica: str | None, placing: bool = False) -> list[Any]:
        """A chunk of `stream` was answered by `replica` (None: no state was made: the call failed or was
        dropped, or the chunk carried the Talker's PCM); the stream's state is there now if this is its latest
        answer. `placing`: the chunk placed the stream; the items held for it come back (to `place` again)."""
        state = self._streams.get(stream)
        if replica is not None:
            self._answering.add(replica)
        if state is None:  # forgotten meanwhile: nothing to keep
            return []
        if replica is not None and seq >= state.latest:
            if state.holder is not None and state.holder != replica:  # the named replica was full or gone: no new
                self._answering.discard(state.holder)  # streams for it until it answers again
            state.holder, state.latest = replica, seq
        if not placing:
            return []
        state.placing = False
        held, state.held = state.held, []
        return held

    def forget(self, stream: str) -> list[Any]:
        """The stream ended (or its client left); returns any items still held for it."""
        state = self._streams.pop(stream, None)
        return state.held if state is not None else []

    def target(self, stream: str | None) -> str | None:
        """The replica named for the stream's next chunk (None: any)."""
        state = self._streams.get(stream) if stream is not None else None
        return state.holder if state is not None else None

    def _fewest_streams(self) -> str:
        """The answering replica holding (or named for) the fewest of these streams, ties at random: 16 ingress
        replicas must not all pick the same one. Counted from the streams when a new one comes (a few hundred per
        ingress replica), so the count cannot drift from where the streams are."""
        held = Counter(s.holder for s in self._streams.values())
        fewest = min(held[r] for r in self._answering)
        return random.choice([r for r in self._answering if held[r] == fewest])


class StreamAffinityRouter(RequestRouter):
    """Code2Wav's request router: a call that names a replica goes there first, the others by load."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [_two_of(candidate_replicas)] if candidate_replicas else []
        # every round offers every rank it has: when none of them accepts, Serve waits before the next round
        # (without this, a full deployment spins: each round asks the full replicas for their queue lengths again)
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(TARGET_KWARG)
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    others = [r for r in candidate_replicas if r is not replica]
                    return [[replica], _two_of(others)] if others else [[replica]]
        return [_two_of(candidate_replicas)] if candidate_replicas else []


def _two_of(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Two replicas in random order (Serve then takes the one with the shorter queue that accepts the request, the
    first on a tie: two replicas offered in list order sent every call between idle ones to the first, as the
    split run's stats calls found on 2026-11-28)."""
    return random.sample(replicas, min(2, len(replicas)))
