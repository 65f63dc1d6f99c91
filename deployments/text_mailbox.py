"""TextMailbox: live text from an ingress replica's WebSocket contexts to the Talker replicas speaking them.

A live request runs in a streaming `Talker.generate_live_many` call, but its text keeps arriving after the call
started, and a later Serve call could reach another Talker replica (Serve routes each call on its own). So
each ingress replica owns one small Ray actor, its mailbox: the ingress puts each context's text events in
it (the first put makes the context's box: opening a context costs the ingress no call of its own), and the Talker
replica that runs the request takes them. A Talker replica takes the events of all its requests from one mailbox in
one long poll (`take_many`: it returns as soon as any of them has something, not on a timer), so a replica speaking
many live contexts makes one actor call per batch of text, not one per event and context. A request the replica
starts while its poll waits is claimed (`claim_many`: the requests it starts while one such call is under way go in
the next): the waiting poll takes it in at once, so a burst of new requests does not restart the poll once per
request. Ray runs one caller's calls to an actor in submission order, but an async actor
may interleave them: the ingress awaits each put, so a context's events arrive in the order the client sent them.
The ingress's side is a `MailboxWriter`: the puts (and closes) of all its contexts made while one `put_many` call is
under way go together in the next (an actor call costs the ingress's event loop a few hundred microseconds of Python: one per
word of every live context had been its largest cost at 128 connections).
The mailbox dies with the ingress replica that owns it; the Talker's poll then fails and its requests end (their
clients are gone too).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Literal

import ray

from deployments.coalescing import Coalescer, ignore_failure

TextEventKind = Literal["append", "flush", "end"]


@dataclass(frozen=True)
class TextEvent:
    kind: TextEventKind
    text: str = ""


class _Box:
    def __init__(self) -> None:
        self.events: list[TextEvent] = []
        self.taker: str | None = None  # the Talker poll that claimed this box (woken by its puts)


# closed boxes remembered, so that a late put is refused and a late claim ends its request, without growing
# without bound: a box is closed once, and a late call follows its close within seconds (released takers alike)
_CLOSED_KEPT = 65_536


def _remember(recent: dict[str, None], key: str) -> None:
    """`key` added to an insertion-ordered set of at most _CLOSED_KEPT keys (the oldest goes first)."""
    recent[key] = None
    if len(recent) > _CLOSED_KEPT:
        del recent[next(iter(recent))]


@ray.remote(num_cpus=0)
class TextMailbox:
    """One per ingress replica. Keyed by request id; a box exists from its first `put` or `claim` until `close`."""

    def __init__(self) -> None:
        self._boxes: dict[str, _Box] = {}
        self._closed: dict[str, None] = {}  # recently closed request ids, oldest first
        self._takers: dict[str, asyncio.Event] = {}  # by taker key: set when a box it claimed changes
        self._claims: dict[str, set[str]] = {}  # by taker key: the request ids its polls take
        # recently released taker keys, oldest first: a poll or claim of theirs that arrives after the release (a
        # pump's last call, sent before it released) ends at once instead of waiting, and holding memory, forever
        self._released: dict[str, None] = {}

    def put(self, request_id: str, events: list[TextEvent]) -> bool:
        """False when the request's box is closed: its context has ended."""
        box = self._box(request_id)
        if box is None:
            return False
        box.events.extend(events)
        self._notify(box.taker)
        return True

    def put_many(self, items: list[tuple[str, list[TextEvent] | None]]) -> list[bool]:
        """`put` of each (request id, events), in order; events None: `close` the request's box (True)."""
        out = []
        for request_id, events in items:
            if events is None:
                self.close(request_id)
                out.append(True)
            else:
                out.append(self.put(request_id, events))
        return out

    def claim_many(self, taker: str, request_ids: list[str]) -> None:
        """`claim` of each request: a burst of a Talker replica's new requests in one call."""
        for request_id in request_ids:
            self.claim(taker, request_id)

    def claim(self, taker: str, request_id: str) -> None:
        """`taker`'s polls take `request_id`'s events from now on, a waiting one included."""
        if taker in self._released:
            return
        self._claims.setdefault(taker, set()).add(request_id)
        box = self._box(request_id)
        if box is not None:
            box.taker = taker
        if box is None or box.events:  # something to take now: its text, or [] for a closed box
            self._notify(taker)

    async def take_many(self, taker: str, request_ids: list[str]) -> dict[str, list[TextEvent]]:
        """The queued events of `taker`'s claimed requests (`request_ids` claims them too) that have some, and [] for
        each whose box is closed (it is unclaimed then), as soon as there is one of either; {} when `release(taker)`
        ends the wait, or at once when it came after that release. `taker`: the caller's key (one per Talker replica
        and mailbox; never used again once released)."""
        if taker in self._released:
            return {}
        arrived = self._takers.setdefault(taker, asyncio.Event())
        claimed = self._claims.setdefault(taker, set())
        for request_id in request_ids:
            self.claim(taker, request_id)
        while True:
            out = {}
            for request_id in list(claimed):
                box = self._boxes.get(request_id)
                if request_id in self._closed:
                    out[request_id] = []
                    claimed.discard(request_id)
                elif box is not None and box.events:
                    out[request_id], box.events = box.events, []
            if out or arrived.is_set():
                arrived.clear()
                return out
            await arrived.wait()

    def release(self, taker: str) -> None:
        """`taker` polls no more (its replica speaks no request from here now): forget it and its claims, ending a
        poll of its that is still waiting (one its caller stopped awaiting)."""
        self._claims.pop(taker, None)
        _remember(self._released, taker)
        arrived = self._takers.pop(taker, None)
        if arrived is not None:
            arrived.set()

    def close(self, request_id: str) -> None:
        box = self._boxes.pop(request_id, None)
        _remember(self._closed, request_id)
        if box is not None:
            self._notify(box.taker)  # a waiting `take_many` returns [] for it

    def _box(self, request_id: str) -> _Box | None:
        """The request's box, made on first use; None once it is closed."""
        if request_id in self._closed:
            return None
        box = self._boxes.get(request_id)
        if box is None:
            box = self._boxes[request_id] = _Box()
        return box

    def _notify(self, taker: str | None) -> None:
        if taker is not None and (arrived := self._takers.get(taker)) is not None:
            arrived.set()

    def open_boxes(self) -> int:
        return len(self._boxes)

    def takers(self) -> int:
        return len(self._takers)


class MailboxWriter:
    """An ingress replica's side of its mailbox (event-loop side only): `put`s and `close`s coalesced into few
    `put_many` calls. `handle` is the actor, for the Talker calls that read from it."""

    def __init__(self, handle):
        self.handle = handle
        self._puts: Coalescer[tuple[str, list[TextEvent] | None], bool] = Coalescer(self._put_many)

    async def put(self, request_id: str, events: list[TextEvent]) -> bool:
        """False when the request's box is closed (its context has ended). Awaited: a context's next events are put
        after these (the batches run one after another, each in the order its puts came)."""
        return await self._puts.submit((request_id, events))

    def close(self, request_id: str) -> None:
        """The context ended: its box closes (the Talker aborts the request if it still runs), in the next batch,
        after its own puts. Not awaited: a lost mailbox fails the Talker's poll as well, which ends its requests."""
        self._puts.submit_nowait((request_id, None)).add_done_callback(ignore_failure)

    async def _put_many(self, items: list[tuple[str, list[TextEvent] | None]]) -> list[bool]:
        return await self.handle.put_many.remote(items)


def new_mailbox():
    """A mailbox owned by the calling process (an ingress replica), on its node when there is room."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = ray.get_runtime_context().get_node_id()
    return TextMailbox.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=True), max_concurrency=10_000,
    ).remote()
