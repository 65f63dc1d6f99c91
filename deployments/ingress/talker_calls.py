"""TalkerCalls: an ingress replica's Talker requests, started in batches, one streaming Serve call per batch.

Every speech request (HTTP, batch jobs' items, each piece of a long input) and every live request of a WebSocket
context (deployments/ingress/live_pieces.py) reaches its Talker this way. A Serve call costs the replica that
accepts it about a millisecond or more of its event loop (routing metadata, gRPC, deserializing its arguments),
and the router's own work per call; with one call per request a burst of arrivals (a voice agent's turn, the
first wave of a load, a benchmark's round) queued in the Talker replica: the last of 128 live contexts waited
~200 ms for its call to start, the first 512 HTTP requests of a closed-loop run ~180-350 ms
(`to_talker_call` / `to_talker`, docs/results.md). Here the requests this ingress replica starts while one batch
is being admitted wait and go together in the next: one `Talker.generate_many` (speech) or
`Talker.generate_live_many` (live) call, at most `max_batch` requests and, where the transport bounds a message
(gRPC), about `max_bytes` of them (a voice clone's reference codes weigh up to ~100 KB each), whose stream carries
the items of all of them (`CallItem`); each request reads its own (`CallStream`). A lone request goes at once; a
burst pays a few calls.

What a batch shares, and what it does not:
- Admission: the call is made, then the next batch forms until this one's first message (its requests'
  `Admitted`, or their refusals) arrives, or `admission_wait_s` passed (a slow replica does not hold the next batch).
- Refusal and failure: Serve refusing the call (backpressure) or the call failing fails each of its requests that
  had not ended, with that error; a request the Talker refuses (its engine's queue) or that fails there ends alone
  with its error. Serve's `max_ongoing_requests` bounds calls, not the requests in them, so a Talker replica refuses
  a speech request beyond its config's `max_ongoing_requests` open (`ReplicaFullError`; Serve's own bound is set
  above it, `TalkerDeploymentConfig.max_ongoing_calls`, so that Serve does not hold a whole batch at the caller)
  and the request goes again in a later batch, which Serve's router may send to another replica (a new one,
  scaling up): as Serve holds a one-request call at the caller while every replica is full. At most
  `max_retrying` requests wait so (the config's `max_queued_requests`), each counted until a replica admits it
  or it ends; beyond, the refusal is the request's answer (an overload: 429 and `Retry-After`).
- Cancellation: one request ends early through its box in this replica's `TextMailbox` (closing it makes the
  Talker abort that request alone): a live context closes its own box; a speech request's box is closed here when
  its reader stops (`close_box`), ended or not, so that the mailbox keeps no box of it. When no request of a call
  is read any more the call itself is cancelled (which aborts any left).
- Serve counts a batch as one ongoing request of the Talker replica: its router balances batches, not requests
  (hence the bound on a batch), and the Talker's autoscaling policy reads the engine's own counts
  (deployments/autoscaling.py). A live request waiting for text takes no engine slot.

The calls are made from a task without the caller's Serve request context: a batch is not the child of the
request whose context happened to start it, so Serve does not cancel it when that one ends.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field

from deployments import first_audio_timing
from deployments.first_audio_timing import FirstAudioTiming
from deployments.messages import Admitted, CallItem, GenerateOptions, ReplicaFullError
from stages.contract import CodecChunk, SynthesisRequest

_END = object()


class TalkerCallEndedError(RuntimeError):
    """The Talker's call ended without this request's end (its replica stopped the stream)."""


class CallStream:
    """One request's items from its batch's call: `Admitted`, then its codec chunks until the Talker says it ended;
    the error that refused or ended it is raised in their place. One reader; `cancel()` when it stops reading."""

    def __init__(self, calls: TalkerCalls, request: SynthesisRequest, options: GenerateOptions,
                 timing: FirstAudioTiming | None):
        self._calls, self.request, self.options, self.timing = calls, request, options, timing
        self._items: asyncio.Queue = asyncio.Queue()  # unbounded: the reader runs beside the other requests'
        self._call: _Call | None = None
        self.closed = False  # ended (its last item queued) or cancelled: nothing more is routed to it
        self._box_closed = False

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> Admitted | CodecChunk:
        item = await self._items.get()
        if item is _END:
            self._items.put_nowait(_END)  # and after
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._items.put_nowait(_END)
            raise item
        return item

    def cancel(self) -> None:
        """The reader is done: nothing more is routed here; the call is cancelled once none of its requests reads,
        and a speech request's box closes (the Talker aborts it if it still runs)."""
        if not self.closed:
            self._end(None)
            if self._call is not None:
                self._call.cancel_if_unread()
        if self._calls.close_box is not None and not self._box_closed:
            self._box_closed = True
            self._calls.close_box(self.request.request_id)

    def _deliver(self, item: CallItem) -> None:
        if item.error is not None or item.item is None:  # its error, or its end
            self._end(item.error)
        else:
            if isinstance(item.item, Admitted):
                self._calls.slot_found(self)
            self._items.put_nowait(item.item)

    def _end(self, error: BaseException | None) -> None:
        self.closed = True
        self._calls.slot_found(self)
        self._items.put_nowait(error if error is not None else _END)
        if self._call is not None:
            self._call.forget(self)
        else:
            self._calls.discard(self)


@dataclass(eq=False)
class _Call:
    """One batched call (`generate_many` or `generate_live_many`) and the requests of it still read."""

    streams: dict[str, CallStream]
    admitted: asyncio.Event = field(default_factory=asyncio.Event)  # its first message came (or it failed)
    task: asyncio.Task | None = None

    def forget(self, stream: CallStream) -> None:
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


class TalkerCalls:
    """The requests of one kind (speech or live) of one ingress replica to one Talker deployment (event-loop side
    only)."""

    def __init__(self, talker, mailbox, max_batch: int, admission_wait_s: float, max_bytes: int | None = None,
                 live: bool = False, close_box: Callable[[str], None] | None = None, max_retrying: int = 0,
                 retry_after_s: float = 0.02):
        """`talker`: the Talker deployment's handle; `mailbox`: the ingress replica's `TextMailbox` handle, where
        live requests' text comes from and every request's box says when it is cancelled; `max_bytes`: what one
        call's requests may weigh together (`payload_bytes`; None: unbounded), one request always goes. `live`:
        the requests are live (`generate_live_many`), else speech (`generate_many`); `close_box`: closes a request's
        box when its reader stops (speech: `MailboxWriter.close`; a live context closes its own); `max_retrying`:
        requests a full replica refused that wait to go again, at most (the next refusal is the answer);
        `retry_after_s`: how long they wait before their next batch."""
        self._talker = talker.options(stream=True)
        self._mailbox = mailbox
        self.live, self.close_box = live, close_box
        self._max_batch, self._admission_wait_s, self._max_bytes = max_batch, admission_wait_s, max_bytes
        self._waiting: list[CallStream] = []  # started, not yet in a call
        self._retrying: list[CallStream] = []  # refused by a full replica, to go again after `retry_after_s`
        # refused by a full replica and neither admitted nor ended since: in `_retrying`, `_waiting` or a call again
        self._seeking_slot: set[CallStream] = set()
        self._max_retrying, self._retry_after_s = max_retrying, retry_after_s
        self._retry: asyncio.Task | None = None
        self._drainer: asyncio.Task | None = None
        self.calls = 0  # calls made (tests, stats)

    def open(self, request: SynthesisRequest, options: GenerateOptions,
             timing: FirstAudioTiming | None = None) -> CallStream:
        """Start a request: it goes in the next batch. `timing`: its first audio's stamps (the call's time)."""
        stream = CallStream(self, request, options, timing)
        self._waiting.append(stream)
        self._start_drainer()
        return stream

    def discard(self, stream: CallStream) -> None:
        """A request cancelled before its batch left: it is not sent."""
        for queue in (self._waiting, self._retrying):
            if stream in queue:
                queue.remove(stream)

    def _start_drainer(self) -> None:
        if self._drainer is None or self._drainer.done():
            # a task of its own context: the calls are not children of the Serve request that made this one
            self._drainer = asyncio.get_running_loop().create_task(self._drain(), context=contextvars.Context())

    def slot_found(self, stream: CallStream) -> None:
        """`stream` was admitted, or ended: it no longer waits for a slot."""
        self._seeking_slot.discard(stream)

    def _send_again(self, call: _Call, stream: CallStream) -> bool:
        """A request a full replica refused waits to go in a later batch; False when `max_retrying` others already
        wait (counted until they are admitted or end, wherever they are meanwhile: a request refused again keeps
        its place, and one sent again is still waiting while its call is routed)."""
        if stream not in self._seeking_slot and len(self._seeking_slot) >= self._max_retrying:
            return False
        self._seeking_slot.add(stream)
        call.forget(stream)
        stream._call = None
        self._retrying.append(stream)
        if self._retry is None or self._retry.done():
            self._retry = asyncio.get_running_loop().create_task(self._requeue(), context=contextvars.Context())
        return True

    async def _requeue(self) -> None:
        await asyncio.sleep(self._retry_after_s)
        self._waiting[:0], self._retrying = self._retrying, []  # ahead of the requests started since
        self._start_drainer()

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

    def _next_batch(self) -> list[CallStream]:
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
        method = self._talker.generate_live_many if self.live else self._talker.generate_many
        return method.remote([(stream.request, stream.options) for stream in call.streams.values()], self._mailbox)

    async def _run(self, call: _Call, generator) -> None:
        error: BaseException = TalkerCallEndedError("the Talker's call ended before this request did")
        try:
            async for items in generator:
                call.admitted.set()
                for item in items:
                    if (stream := call.streams.get(item.request_id)) is None:
                        continue
                    if not (isinstance(item.error, ReplicaFullError) and self._send_again(call, stream)):
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
