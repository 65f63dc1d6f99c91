"""StreamPlacement: where each stream's Code2Wav state is, so the ingress names that replica in its decode calls.

A stateful Code2Wav replica (docs/code2wav.md section 6) decodes only a chunk's new frames when it holds the
stream's state; any other replica decodes the chunk over its left context: correct, but about twice the work at
the serving defaults (as much context as new frames). Serve routes each call by load, so with N Code2Wav replicas
(N - 1) / N of a stream's later chunks would land on a replica without its state.

Two halves, one in each process:
- `StreamPlacement` (here: the ingress's DecodeBatcher, no Ray): which replica decoded each stream's latest chunk
  (`DecodedChunk.replica`), so the next call of that stream names it. A new stream's chunks go by load until an
  answer names a replica, and the stream's state is where they land. While the chunk that places a stream is out,
  the stream's next chunks wait for its answer instead of going wherever the load sends them: they would start a
  second state on another replica (a stream's first chunks never wait: their listener does).
- `StreamAffinityRouter` (deployments/code2wav/router.py, set as the Code2Wav deployment's
  `request_router_config` where affinity is on): a call that names a replica (`decode_many(chunks, replica=...)`)
  goes to it while it accepts work; when it is full or gone, the call goes by load like any other, and its chunks
  decode over their left context there; the answer says where the state now is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


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

    A stream's early chunks (its first two: a listener waits for the first, and the second must follow within the
    first's audio) are never held: they leave at once, by load until an answer names a replica.
    The first later chunk that finds no replica named places the stream, and the ones after it wait for its answer.
    """

    def __init__(self):
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def place(self, stream: str | None, item: Any, early: bool = False) -> Placement:
        """What to do with `item`, a chunk of `stream`; a held one comes back from `settle`."""
        if stream is None:
            return Placement.LEAVE
        state = self._streams.get(stream)
        if state is None:
            state = self._streams[stream] = _Stream()
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
        if state is None:  # forgotten meanwhile: nothing to keep
            return []
        if replica is not None and seq >= state.latest:
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
