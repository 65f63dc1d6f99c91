"""Stream affinity: a stream's Code2Wav decodes go to the replica that holds its decoder state.

A stateful Code2Wav replica (docs/code2wav.md section 6) decodes only a chunk's new frames when it holds the
stream's state; any other replica decodes the chunk over its left context: correct, but about twice the work at
the serving defaults (25 frames of context for a 25-frame chunk). Serve routes each call by load, so with N
Code2Wav replicas (N - 1) / N of a stream's later chunks landed on a replica without its state (replicas.yaml
on 4 GPUs: 3 in 4).

Two halves, one in each process:
- `StreamPlacement` (the ingress's DecodeBatcher, no Ray): which replica decoded each stream's latest chunk
  (`DecodedChunk.replica`), so the next call of that stream names it. While a stream's first decode is out, its
  next chunks wait for the answer instead of going wherever the load sends them: they would start a second
  state on another replica, and every chunk after them would bounce between the two.
- `StreamAffinityRouter` (Serve's public request-router interface, set as the Code2Wav deployment's
  `request_router_config`): a call that names a replica (`decode_many(chunks, replica=...)`) goes to it while it
  accepts work; when it is full or gone, the call goes by load like any other (power of two choices on queue
  length), and its chunks decode over their left context there; the answer says where the state now is.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.config import TTSServingArgs

TARGET_KWARG = "replica"  # decode_many's keyword argument that names the replica holding the chunks' streams

_PLACING = object()  # the stream's first decode is out: where its state will be is not known yet


def stream_affinity(args: TTSServingArgs) -> bool:
    """Whether the ingress keeps streams on their Code2Wav replica (`ingress.decode_batch.stream_affinity`; auto:
    a stateful Code2Wav that may run several replicas, where a call by load often misses the stream's state)."""
    choice = args.ingress.decode_batch.stream_affinity
    return choice == "on" or (choice == "auto" and args.code2wav.stateful and args.code2wav.may_run_several_replicas())


class StreamPlacement:
    """Per stream: where its Code2Wav state is. Entries live from a stream's first chunk to `forget`."""

    def __init__(self):
        self._holder: dict[str, object] = {}  # stream -> replica id, or _PLACING
        self._latest: dict[str, int] = {}  # stream -> seq of the answer that set its holder
        self._waiting: dict[str, list[Any]] = {}  # stream -> items held back while its first decode is out

    def __len__(self) -> int:
        return len(self._holder)

    def place(self, stream: str | None, item: Any) -> bool:
        """Whether `item` (a chunk of `stream`) may leave now; one that may not is held until `settle` for its
        stream returns it. Its call names `target(stream)`."""
        if stream is None:
            return True
        holder = self._holder.get(stream)
        if holder is None:  # the stream's first chunk for Code2Wav: by load, and the others wait for its answer
            self._holder[stream] = _PLACING
            return True
        if holder is _PLACING:
            self._waiting.setdefault(stream, []).append(item)
            return False
        return True

    def settle(self, stream: str, seq: int, replica: str | None) -> list[Any]:
        """A chunk of `stream` was answered by `replica`: the stream's state is there now if this is its latest
        answer. `replica` None: no state was made (the call failed, or the chunk carried the Talker's PCM), so
        a stream not placed yet is placed by its next chunk. Returns the items held back for the stream."""
        holder = self._holder.get(stream)
        if holder is None:  # forgotten meanwhile: nothing to keep
            return []
        if replica is None:
            if holder is _PLACING:
                del self._holder[stream]
        elif seq >= self._latest.get(stream, -1):
            self._latest[stream] = seq
            self._holder[stream] = replica
        return self._waiting.pop(stream, [])

    def forget(self, stream: str) -> list[Any]:
        """The stream ended (or its client left); returns any items still held back for it."""
        self._holder.pop(stream, None)
        self._latest.pop(stream, None)
        return self._waiting.pop(stream, [])

    def target(self, stream: str | None) -> str | None:
        """The replica named for the stream's next chunk (None: any)."""
        holder = self._holder.get(stream) if stream is not None else None
        return holder if isinstance(holder, str) else None


class StreamAffinityRouter(RequestRouter):
    """Code2Wav's request router: a call that names a replica goes there first, the others by load."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.kwargs.get(TARGET_KWARG) if pending_request is not None else None
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    others = [r for r in candidate_replicas if r is not replica]
                    return [[replica], _two_of(others)] if others else [[replica]]
        return [_two_of(candidate_replicas)] if candidate_replicas else []


def _two_of(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Two replicas at random (Serve then takes the one with the shorter queue that accepts the request)."""
    return random.sample(replicas, 2) if len(replicas) > 2 else list(replicas)
