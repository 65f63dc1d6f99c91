"""LiveTextPump: one Talker replica's live requests' text, from one ingress replica's mailbox into the engine, and
the closes of its batched requests' boxes there (a speech request's close is its cancellation: it gets no text).

Each live request's text arrives in the `TextMailbox` of the ingress replica that holds its WebSocket context
(deployments/text_mailbox.py). A replica speaking many live contexts used to await one `take` per
request and event; a pump instead holds every request of this replica that reads from one mailbox and asks for
all of their events in one long poll (`take_many`), so the replica's event loop makes one actor call per batch
of text, however many contexts share the mailbox. A request added while a poll waits is claimed (`claim_many`, not
awaited by the request): the waiting poll takes its text in at once, without ending and asking again, and the
requests added while one claim call is under way go together in the next, so a burst of arrivals costs the
replica's event loop a few calls, not one each. A closed box (the ingress ended the context) or a lost mailbox (its
ingress replica is gone, and with it the client) aborts the request in the engine, as an ended request's stream
would.

The pump notes when each request's first text reached the engine (`first_text_at`): the live first audio's
`to_talker_text` stage ends there (deployments/first_audio_timing.py).
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from deployments import first_audio_timing

# imported with the Talker, not with its first live call: unpickling the mailbox's handle and events needs it
from deployments.text_mailbox import TextEvent
from stages.contract import InvalidRequestError

logger = logging.getLogger("ray.serve")


class LiveTextPump:
    """The live requests of one Talker replica whose text comes from one mailbox. Event-loop side only."""

    def __init__(self, engine, mailbox):
        """`engine`: the replica's engine (`append_text`, `flush_text`, `end_text`, `abort`); `mailbox`: a
        `TextMailbox` actor handle."""
        self._engine, self._mailbox = engine, mailbox
        self._taker = uuid.uuid4().hex  # this pump's key in the mailbox: its polls and their wake-ups
        self._requests: set[str] = set()
        self._first_text: dict[str, float] = {}  # request -> wall time its first text was handed to the engine
        self._task: asyncio.Task | None = None
        self._to_claim: list[str] = []  # added while the poll waits, not yet claimed
        self._claiming: asyncio.Task | None = None

    @property
    def requests(self) -> frozenset[str]:
        return frozenset(self._requests)

    def add(self, request_id: str) -> None:
        """Take `request_id`'s text from now on (its box is made by whichever comes first: its text or this)."""
        self._requests.add(request_id)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        else:  # a poll for the other requests may be waiting: it takes this one in too
            self._to_claim.append(request_id)
            if self._claiming is None or self._claiming.done():
                self._claiming = asyncio.get_running_loop().create_task(self._claim())

    def first_text_at(self, request_id: str) -> float | None:
        """When the request's first text was handed to the engine (`first_audio_timing.now()`; None: not yet)."""
        return self._first_text.get(request_id)

    def remove(self, request_id: str) -> None:
        """The request ended here (its stream closed): its text is moot. The poll stops with the last one, and the
        mailbox forgets this pump (the server makes a new one for the next request from it)."""
        self._requests.discard(request_id)
        self._first_text.pop(request_id, None)
        if not self._requests and self._task is not None:
            self._task.cancel()
            self._task = None
            if self._claiming is not None:  # nothing left to claim (a call already sent goes before the release)
                self._claiming.cancel()
                self._claiming, self._to_claim = None, []
            self._mailbox.release.remote(self._taker)
            self._taker = uuid.uuid4().hex  # a released key ends its polls at once: a later `add` polls under a new one

    async def _claim(self) -> None:
        try:
            while self._to_claim:
                request_ids = [r for r in self._to_claim if r in self._requests]
                self._to_claim = []
                if request_ids:
                    await self._mailbox.claim_many.remote(self._taker, request_ids)
        except Exception:  # the mailbox is gone: the poll fails too, and ends its requests (`_run`); a cancel ends this
            self._to_claim = []

    async def _run(self) -> None:
        try:
            while self._requests:
                taken = await self._mailbox.take_many.remote(self._taker, list(self._requests))
                for request_id, events in taken.items():
                    if request_id in self._requests:
                        self._deliver(request_id, events)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the mailbox is gone: its ingress replica, and so the clients, are gone
            logger.warning(f"live text of {len(self._requests)} request(s) lost (their ingress is gone?): {e!r}")
            for request_id in list(self._requests):
                self._requests.discard(request_id)
                self._engine.abort(request_id)

    def _deliver(self, request_id: str, events: list[TextEvent]) -> None:
        """Hand one request's events to the engine; [] means its box was closed (the ingress ended it)."""
        engine = self._engine
        if not events:
            self._requests.discard(request_id)
            engine.abort(request_id)
            return
        try:
            for event in events:
                if event.kind == "append":
                    engine.append_text(request_id, event.text)
                    if request_id not in self._first_text:
                        self._first_text[request_id] = first_audio_timing.now()
                elif event.kind == "flush":
                    engine.flush_text(request_id)
                else:
                    engine.end_text(request_id)
                    self._requests.discard(request_id)  # nothing follows `end`
                    return
        except InvalidRequestError:  # the request ended first (max_frames, error): text after it is moot
            self._requests.discard(request_id)
