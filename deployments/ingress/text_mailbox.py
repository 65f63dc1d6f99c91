"""TextMailbox: live text from an ingress replica's WebSocket contexts to the Talker replicas speaking them.

A live request is one streaming `Talker.generate_live` call, but its text keeps arriving after the call
started, and a later Serve call could reach another Talker replica (Serve routes each call on its own). So
each ingress replica owns one small Ray actor, its mailbox: the ingress puts each context's text events in
it, and the Talker replica that runs the request awaits them (`take` returns as soon as there is something,
a long poll, not a timer). Ray runs one caller's calls to an actor in submission order, so a context's
events arrive in the order the client sent them. The mailbox dies with the ingress replica that owns it;
the Talker's `take` then fails and the request ends (its client is gone too).
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
        self.arrived = asyncio.Event()


@ray.remote(num_cpus=0)
class TextMailbox:
    """One per ingress replica. Keyed by request id; a box exists from `open` until `close`."""

    def __init__(self) -> None:
        self._boxes: dict[str, _Box] = {}

    def open(self, request_id: str) -> None:
        self._boxes.setdefault(request_id, _Box())

    def put(self, request_id: str, events: list[TextEvent]) -> bool:
        """False when the request's box is gone (closed): its Talker stream has ended."""
        box = self._boxes.get(request_id)
        if box is None:
            return False
        box.events.extend(events)
        box.arrived.set()
        return True

    async def take(self, request_id: str) -> list[TextEvent]:
        """Every event queued for the request, as soon as there is one; [] once the box is closed."""
        box = self._boxes.get(request_id)
        if box is None:
            return []
        await box.arrived.wait()
        events, box.events = box.events, []
        box.arrived.clear()
        return events

    def close(self, request_id: str) -> None:
        box = self._boxes.pop(request_id, None)
        if box is not None:
            box.arrived.set()  # a waiting `take` returns what is left (or [])

    def open_boxes(self) -> int:
        return len(self._boxes)


def new_mailbox():
    """A mailbox owned by the calling process (an ingress replica), on its node when there is room."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return TextMailbox.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True), max_concurrency=10_000,
    ).remote()
