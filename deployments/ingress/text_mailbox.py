"""TextMailbox: live text from an ingress replica's WebSocket contexts to the Talker replicas speaking them.

A live request is one streaming `Talker.generate_live` call, but its text keeps arriving after the call
started, and a later Serve call could reach another Talker replica (Serve routes each call on its own). So
each ingress replica owns one small Ray actor, its mailbox: the ingress puts each context's text events in
it, and the Talker replica that runs the request takes them. A Talker replica takes the events of all its
requests from one mailbox in one long poll (`take_many`: it returns as soon as any of them has something, not
on a timer), so a replica speaking many live contexts makes one actor call per batch of text, not one per
event and context; `wake` ends a waiting poll early when the replica's set of requests grows. Ray runs one
caller's calls to an actor in submission order, so a context's events arrive in the order the client sent
them. The mailbox dies with the ingress replica that owns it; the Talker's poll then fails and its requests
end (their clients are gone too).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import ray

TextEventKind = Literal["append", "flush", "end"]


@dataclass(frozen=True)
class TextEvent:
    kind: TextEventKind
    text: str = ""


class _Box:
    def __init__(self) -> None:
        self.events: list[TextEvent] = []
        self.taker: str | None = None  # the Talker poll that last asked for this box (woken by its puts)


@ray.remote(num_cpus=0)
class TextMailbox:
    """One per ingress replica. Keyed by request id; a box exists from `open` until `close`."""

    def __init__(self) -> None:
        self._boxes: dict[str, _Box] = {}
        self._takers: dict[str, asyncio.Event] = {}  # by taker key: set when a box it asked for changes

    def open(self, request_id: str) -> None:
        self._boxes.setdefault(request_id, _Box())

    def put(self, request_id: str, events: list[TextEvent]) -> bool:
        """False when the request's box is gone (closed): its Talker stream has ended."""
        box = self._boxes.get(request_id)
        if box is None:
            return False
        box.events.extend(events)
        self._notify(box.taker)
        return True

    async def take_many(self, taker: str, request_ids: list[str]) -> dict[str, list[TextEvent]]:
        """The queued events of those of `request_ids` that have some, and [] for each whose box is closed (or
        was never opened), as soon as there is one of either; {} when `wake(taker)` ends the wait first.
        `taker`: the caller's key (one per Talker replica and mailbox), whose wake-ups this call waits on."""
        arrived = self._takers.setdefault(taker, asyncio.Event())
        for request_id in request_ids:
            if (box := self._boxes.get(request_id)) is not None:
                box.taker = taker
        while True:
            out = {}
            for request_id in request_ids:
                box = self._boxes.get(request_id)
                if box is None:
                    out[request_id] = []
                elif box.events:
                    out[request_id], box.events = box.events, []
            if out or arrived.is_set():
                arrived.clear()
                return out
            await arrived.wait()

    def wake(self, taker: str) -> None:
        """End `taker`'s waiting `take_many` (or its next one) with what it has: it asks again for a new set."""
        self._takers.setdefault(taker, asyncio.Event()).set()

    def release(self, taker: str) -> None:
        """`taker` polls no more (its replica speaks no request from here now): forget it, ending a poll of its that
        is still waiting (one its caller stopped awaiting)."""
        arrived = self._takers.pop(taker, None)
        if arrived is not None:
            arrived.set()

    def close(self, request_id: str) -> None:
        box = self._boxes.pop(request_id, None)
        if box is not None:
            self._notify(box.taker)  # a waiting `take_many` returns [] for it

    def _notify(self, taker: str | None) -> None:
        if taker is not None and (arrived := self._takers.get(taker)) is not None:
            arrived.set()

    def open_boxes(self) -> int:
        return len(self._boxes)

    def takers(self) -> int:
        return len(self._takers)


def new_mailbox():
    """A mailbox owned by the calling process (an ingress replica), on its node when there is room."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return TextMailbox.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True), max_concurrency=10_000,
    ).remote()
