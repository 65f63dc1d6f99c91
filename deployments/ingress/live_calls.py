"""LiveCalls: an ingress replica's live Talker requests, started in batches, one streaming Serve call per batch.

Each WebSocket context speaks through live Talker requests (deployments/ingress/live_pieces.py). A Serve call
costs the replica that accepts it about a millisecond or more of its event loop (routing metadata, gRPC,
deserializing its arguments), so when one call per request was made, a burst of contexts opening together (a
voice agent's turn, a benchmark's round) queued in the Talker replica: the last of 128 waited ~200 ms for its call
to start (`to_talker_call`, docs/results.md "Live text"). Here the requests this ingress replica starts while one
batch is being admitted wait and go together in the next: one `Talker.generate_live_many` call, at most
`max_batch` requests and, where the transport bounds a message (gRPC), about `max_bytes` of them (a voice clone's
reference codes weigh up to ~100 KB each), whose stream carries the items of all of them (`LiveItem`); each request
reads its own (`LiveStream`). A lone request goes at once; a burst pays a few calls.

What a batch shares, and what it does not:
- Admission: the call is made, then the next batch forms until this one's first message (its requests' admissions)
  arrives, or `admission_wait_s` passed (a slow replica does not hold the next batch).
- Refusal and failure: Serve refusing the call (backpressure) or the call failing fails each of its requests that
  had not ended, with that error; a request the Talker refuses or that fails there ends alone with its error.
- Cancellation: one request ends early through its mailbox box (the context closes it; the Talker's pump aborts
  that request); when no request of a call is read any more the call itself is cancelled (which aborts any left).
- Serve counts a batch as one ongoing request of the Talker replica: its router balances batches, not requests
  (hence the bound on a batch), and the Talker's autoscaling policy reads the engine's own counts
  (deployments/autoscaling.py). A live request waiting for text takes no engine slot.

The calls are made from a task without the caller's Serve request context: a batch is not the child of the
WebSocket request whose context happened to start it, so Serve does not cancel it when that one ends.
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field

from deployments import first_audio_timing
from deployments.first_audio_timing import FirstAudioTiming
from deployments.messages import GenerateOptions, LiveAdmitted, LiveItem
from stages.contract import CodecChunk, SynthesisRequest

_END = object()


class LiveCallEndedError(RuntimeError):
    """The Talker's call ended without this request's end (its replica stopped the stream)."""


class LiveStream:
    """One live request's items from its batch's call: `LiveAdmitted`, then its codec chunks until the Talker says
    it ended; the error that refused or ended it is raised in their place. One reader; `cancel()` when it stops reading."""

    def __init__(self, calls: LiveCalls, request: SynthesisRequest, options: GenerateOptions,
                 timing: FirstAudioTiming | None):
        self._calls, self.request, self.options, self.timing = calls, request, options, timing
        self._items: asyncio.Queue = asyncio.Queue()  # unbounded: the reader runs beside the other requests'
        self._call: _Call | None = None
        self.closed = False  # ended (its last item queued) or cancelled: nothing more is routed to it

    def __aiter__(self) -> LiveStream:
        return self

    async def __anext__(self) -> LiveAdmitted | CodecChunk:
        item = await self._items.get()
        if item is _END:
            self._items.put_nowait(_END)  # and after
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._items.put_nowait(_END)
            raise item
        return item

    def cancel(self) -> None:
        """The reader is done: nothing more is routed here; the call is cancelled once none of its requests reads."""
        if not self.closed:
            self._end(None)
            if self._call is not None:
                self._call.cancel_if_unread()

    def _deliver(self, item: LiveItem) -> None:
        if item.error is not None or item.item is None:  # its error, or its end
            self._end(item.error)
        else:
            self._items.put_nowait(item.item)

    def _end(self, error: BaseException | None) -> None:
        self.closed = True
        self._items.put_nowait(error if error is not None else _END)
        if self._call is not None:
            self._call.forget(self)
        else:
            self._calls.discard(self)


@dataclass(eq=False)
class _Call:
    """One `generate_live_many` call and the requests of it still read."""

    streams: dict[str, LiveStream]
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # its first message came (or it failed)
    task: asyncio.Task | None = None

    def forget(self, stream: LiveStream) -> None:
        self.streams.pop(stream.request.request_id, None)

    def cancel_if_unread(self) -> None:
        """A reader left: with none left the call goes (the Talker aborts what it still runs of it); a call whose
        requests all ended ends by itself."""
        if not self.streams and self.task is not None and not self.task.done():
            self.task.cancel()


def payload_bytes(request: SynthesisRequest) -> int:
    """About what a request weighs in a call's message (an upper estimate): its voice's arrays and its prompt's ids."""
    prompt = request.prompt
    size = 1024 + 8 * (len(prompt.text_ids) + len(prompt.instruct_ids or ()) + len(prompt.role_ids))
    if (voice := prompt.voice) is not None:
        size += voice.x_vector.nbytes + 8 * len(voice.ref_text_ids or ())
        size += voice.ref_codes.nbytes if voice.ref_codes is not None else 0
    return size


class LiveCalls:
    """The live requests of one ingress replica to one Talker deployment (event-loop side only)."""

    def __init__(self, talker, mailbox, max_batch: int, admission_wait_s: float, max_bytes: int | None = None):
        """`talker`: the Talker deployment's handle (`generate_live_many`); `mailbox`: the ingress replica's
        `TextMailbox` handle, where the requests' text comes from; `max_bytes`: what one call's requests may weigh
        together (`payload_bytes`; None: unbounded), one request always goes."""
        self._talker = talker.options(stream=True)
        self._mailbox = mailbox
        self._max_batch, self._admission_wait_s, self._max_bytes = max_batch, admission_wait_s, max_bytes
        self._waiting: list[LiveStream] = []  # started, not yet in a call
        self._drainer: asyncio.Task | None = None
        self.calls = 0  # calls made (tests, stats)

    def open(self, request: SynthesisRequest, options: GenerateOptions,
             timing: FirstAudioTiming | None = None) -> LiveStream:
        """Start a live request: it goes in the next batch. `timing`: its first audio's stamps (the call's time)."""
        stream = LiveStream(self, request, options, timing)
        self._waiting.append(stream)
        if self._drainer is None or self._drainer.done():
            # a task of its own context: the calls are not children of the Serve request that made this one
            self._drainer = asyncio.get_running_loop().create_task(self._drain(), context=contextvars.Context())
        return stream

    def discard(self, stream: LiveStream) -> None:
        """A request cancelled before its batch left: it is not sent."""
        if stream in self._waiting:
            self._waiting.remove(stream)

    async def _drain(self) -> None:
        while self._waiting:
            batch = self._next_batch()
            call = _Call({stream.request.request_id: stream for stream in batch})
            for stream in batch:
                stream._call = call
            call.task = asyncio.get_running_loop().create_task(self._run(call, self._call(call)))
            try:  # the next batch forms meanwhile
                await asyncio.wait_for(call.admitted.wait(), self._admission_wait_s)
            except TimeoutError:
                pass

    def _next_batch(self) -> list[LiveStream]:
        """The waiting requests' first `max_batch`, within `max_bytes` (at least one)."""
        count, size = 0, 0
        for stream in self._waiting[:self._max_batch]:
            size += payload_bytes(stream.request)
            if count and self._max_bytes is not None and size > self._max_bytes:
                break
            count += 1
        batch, self._waiting = self._waiting[:count], self._waiting[count:]
        return batch

    def _call(self, call: _Call):
        """The batch's Serve call, made now (its stream is read by `_run`)."""
        self.calls += 1
        now = first_audio_timing.now()
        for stream in call.streams.values():
            if stream.timing is not None:
                stream.timing.talker_called = now
        return self._talker.generate_live_many.remote(
            [(stream.request, stream.options) for stream in call.streams.values()], self._mailbox)

    async def _run(self, call: _Call, generator) -> None:
        error: BaseException = LiveCallEndedError("the Talker's live call ended before this request did")
        try:
            async for items in generator:
                call.admitted.set()
                for item in items:
                    if (stream := call.streams.get(item.request_id)) is not None:
                        stream._deliver(item)
        except asyncio.CancelledError:
            generator.cancel()
            raise
        except Exception as e:  # refused (backpressure) or failed: each request still here raises it
            error = e
        finally:
            call.admitted.set()
            for stream in list(call.streams.values()):
                stream._end(error)
