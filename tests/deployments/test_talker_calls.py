"""deployments/ingress/talker_calls.py against a Talker handle that records its calls: a burst of requests (live or
speech) goes in few calls, each request reads its own items, errors and cancellation stay per request where they
should."""

from __future__ import annotations

import asyncio
import contextvars
import pickle
import threading

import numpy as np
import pytest

from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress.talker_calls import TalkerCallEndedError, TalkerCalls, payload_bytes
from deployments.messages import Admitted, CallItem, GenerateOptions, ReplicaFullError
from stages.contract import (
    CodecChunk,
    FinishReason,
    InvalidRequestError,
    SynthesisRequest,
    TalkerPrompt,
    VoiceClonePrompt,
)

_CALLER = contextvars.ContextVar("caller", default=None)  # stands in for Serve's request context


class _Call:
    """One `generate_live_many` / `generate_many` call: the test feeds its messages; `cancel()` as Serve's generator
    has it."""

    def __init__(self, batch, mailbox, refuse: BaseException | None, method: str):
        self.request_ids = [request.request_id for request, _ in batch]
        self.method = method
        self.mailbox, self.caller = mailbox, _CALLER.get()
        self.messages: asyncio.Queue = asyncio.Queue()
        self.cancelled = False
        if refuse is not None:
            self.messages.put_nowait(refuse)
        else:  # admitted at once, as the Talker does
            self.messages.put_nowait([CallItem(r, Admitted(r)) for r in self.request_ids])

    def __aiter__(self):
        return self

    async def __anext__(self):
        message = await self.messages.get()
        if message is None:
            raise StopAsyncIteration
        if isinstance(message, BaseException):
            raise message
        return message

    def cancel(self) -> None:
        self.cancelled = True
        self.messages.put_nowait(asyncio.CancelledError())


class _Talker:
    """A Talker deployment handle as TalkerCalls uses it."""

    def __init__(self):
        self.calls: list[_Call] = []
        self.refuse: BaseException | None = None
        self.hold_admission = False

    def options(self, stream: bool = False):
        assert stream
        return self

    @property
    def generate_live_many(self):
        self._method = "generate_live_many"
        return self

    @property
    def generate_many(self):
        self._method = "generate_many"
        return self

    def remote(self, batch, mailbox):
        call = _Call(batch, mailbox, self.refuse, self._method)
        if self.hold_admission:
            call.messages.get_nowait()  # its admission comes when the test sends it
        self.calls.append(call)
        return call


def _request(rid: str) -> SynthesisRequest:
    return SynthesisRequest(rid, TalkerPrompt(text_ids=(), language_id=None))


def _chunk(rid: str, seq: int, final: bool = False) -> CodecChunk:
    return CodecChunk(rid, seq, np.zeros((1, 16), np.int64), 0, final, FinishReason.EOS if final else None)


def _last(rid: str, seq: int) -> list[CallItem]:
    """A request's final chunk and the item that ends its stream, as the Talker sends them."""
    return [CallItem(rid, _chunk(rid, seq, final=True)), CallItem(rid)]


def _key(item) -> tuple:
    """An item as the tests compare it (a chunk's codes are arrays)."""
    if isinstance(item, Admitted):
        return ("admitted", item.request_id)
    return (item.request_id, item.seq, item.final)


async def _read(stream) -> list[tuple]:
    return [_key(item) async for item in stream]


@pytest.fixture
def talker():
    return _Talker()


def test_a_burst_goes_in_few_calls_and_each_request_reads_its_own_items(talker):
    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, live=True)
        first = calls.open(_request("a0"), GenerateOptions())
        await asyncio.sleep(0)  # the lone request leaves at once
        timing = FirstAudioTiming(arrived=0.0, live=True)
        rest = [calls.open(_request(f"b{i}"), GenerateOptions(), timing if i == 0 else None) for i in range(40)]
        readers = [asyncio.ensure_future(_read(s)) for s in [first, *rest]]
        while len(talker.calls) < 3:
            await asyncio.sleep(0)
        assert [c.request_ids for c in talker.calls] == [["a0"], [f"b{i}" for i in range(32)],
                                                         [f"b{i}" for i in range(32, 40)]]
        assert all(c.mailbox == "mailbox" for c in talker.calls)
        assert timing.talker_called is not None  # its batch's call stamps the first audio's `talker_called`
        # items of several requests in one message, in any mix; each request gets its own, in order
        b = talker.calls[1]
        b.messages.put_nowait([CallItem("b1", _chunk("b1", 0)), CallItem("b0", _chunk("b0", 0)), *_last("b1", 1)])
        b.messages.put_nowait([item for i in range(2, 32) for item in _last(f"b{i}", 0)] + _last("b0", 1))
        b.messages.put_nowait(None)
        for call in (talker.calls[0], talker.calls[2]):
            call.messages.put_nowait([item for r in call.request_ids for item in _last(r, 0)])
            call.messages.put_nowait(None)
        return await asyncio.gather(*readers)

    out = asyncio.run(run())
    assert out[0] == [("admitted", "a0"), ("a0", 0, True)]
    assert out[1] == [("admitted", "b0"), ("b0", 0, False), ("b0", 1, True)]
    assert out[2] == [("admitted", "b1"), ("b1", 0, False), ("b1", 1, True)]
    assert all(items == [("admitted", f"b{i}"), (f"b{i}", 0, True)] for i, items in enumerate(out[3:], 2))
    assert not any(c.cancelled for c in talker.calls)  # calls whose requests all ended end by themselves


def test_the_calls_are_not_children_of_the_context_that_started_them(talker):
    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, live=True)
        _CALLER.set("websocket request 1")  # Serve would cancel a child call when this request ends
        stream = calls.open(_request("r"), GenerateOptions())
        while not talker.calls:
            await asyncio.sleep(0)
        stream.cancel()

    asyncio.run(run())
    assert talker.calls[0].caller is None


def test_a_slow_admission_holds_the_next_batch_only_for_its_wait(talker):
    async def run():
        talker.hold_admission = True
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=0.05, live=True)
        loop = asyncio.get_running_loop()
        opened = loop.time()  # the first call's wait starts after this
        calls.open(_request("r0"), GenerateOptions())
        while not talker.calls:
            await asyncio.sleep(0)
        calls.open(_request("r1"), GenerateOptions())
        calls.open(_request("r2"), GenerateOptions())
        for _ in range(3):
            await asyncio.sleep(0)
        if loop.time() - opened < 0.05:  # the wait cannot have run out (a loaded machine may have stalled us past it)
            assert len(talker.calls) == 1  # waiting for the first call's admission
        while len(talker.calls) < 2:  # which never comes: the wait runs out (the event, not the clock, ends ours)
            await asyncio.sleep(0.01)
        assert talker.calls[1].request_ids == ["r1", "r2"]

    asyncio.run(run())


def test_a_refused_call_fails_each_of_its_requests_and_the_next_batch_goes(talker):
    class BackPressure(Exception):
        pass

    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, live=True)
        talker.refuse = BackPressure("queue full")
        refused = [calls.open(_request(f"r{i}"), GenerateOptions()) for i in range(3)]
        results = await asyncio.gather(*(_read(s) for s in refused), return_exceptions=True)
        talker.refuse = None
        later = calls.open(_request("later"), GenerateOptions())
        assert await anext(later) == Admitted("later")
        later.cancel()
        return results

    results = asyncio.run(run())
    assert all(isinstance(r, BackPressure) for r in results)


async def _one_call(talker, names: list[str], messages: list) -> list:
    """Each request's items (or its error) when `names` start together and their call's stream is `messages`."""
    calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, live=True)
    readers = [asyncio.ensure_future(_read(calls.open(_request(r), GenerateOptions()))) for r in names]
    while not talker.calls:
        await asyncio.sleep(0)
    for message in messages:
        talker.calls[0].messages.put_nowait(message)
    return await asyncio.gather(*readers, return_exceptions=True)


def test_a_request_the_talker_refuses_or_fails_ends_alone(talker):
    ok, bad = asyncio.run(_one_call(talker, ["ok", "bad"], [
        [CallItem("bad", error=InvalidRequestError("no such voice")), *_last("ok", 0)], None]))
    assert ok == [("admitted", "ok"), ("ok", 0, True)]
    assert isinstance(bad, InvalidRequestError)


def test_a_call_that_ends_early_fails_the_requests_still_open(talker):
    done, cut = asyncio.run(_one_call(talker, ["done", "cut"], [_last("done", 0), None]))  # no end for "cut"
    assert done == [("admitted", "done"), ("done", 0, True)]
    assert isinstance(cut, TalkerCallEndedError)


def test_a_request_ends_where_the_talker_says_even_without_a_final_chunk(talker):
    """An aborted live request may end without one (its box closed before it spoke)."""
    aborted, = asyncio.run(_one_call(talker, ["aborted"], [[CallItem("aborted")]]))
    assert aborted == [("admitted", "aborted")]


def test_a_call_is_cancelled_once_none_of_its_requests_is_read(talker):
    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, live=True)
        first, second = (calls.open(_request(r), GenerateOptions()) for r in ("one", "two"))
        assert await anext(first) == Admitted("one")
        assert await anext(second) == Admitted("two")
        call = talker.calls[0]
        first.cancel()
        await asyncio.sleep(0)
        assert not call.cancelled  # "two" still reads it
        call.messages.put_nowait([CallItem("one", _chunk("one", 0)), CallItem("two", _chunk("two", 0))])
        assert _key(await anext(second)) == ("two", 0, False)  # nothing of "one" routed any more
        second.cancel()
        while not call.cancelled:
            await asyncio.sleep(0)
        with pytest.raises(StopAsyncIteration):
            await anext(first)
        # a request cancelled before its batch left is never sent
        talker.hold_admission = True
        blocker = calls.open(_request("blocker"), GenerateOptions())
        while len(talker.calls) < 2:
            await asyncio.sleep(0)
        gone = calls.open(_request("gone"), GenerateOptions())
        gone.cancel()
        kept = calls.open(_request("kept"), GenerateOptions())
        talker.calls[1].messages.put_nowait([CallItem("blocker", Admitted("blocker"))])
        while len(talker.calls) < 3:
            await asyncio.sleep(0)
        assert talker.calls[2].request_ids == ["kept"]
        blocker.cancel()
        kept.cancel()

    asyncio.run(run())


def test_a_batch_stays_within_what_one_message_may_carry(talker):
    """Voice-clone requests carry their reference codes (a minute of reference: ~96 KB each): a batch takes as many
    as fit `max_bytes`, one at least, and the rest go in the next."""
    voice = VoiceClonePrompt(np.zeros(2048, np.float32), np.zeros((750, 16), np.int64), tuple(range(300)))
    heavy = [SynthesisRequest(f"v{i}", TalkerPrompt(text_ids=(), language_id=None, voice=voice)) for i in range(7)]
    weight = payload_bytes(heavy[0])
    assert weight > voice.ref_codes.nbytes

    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, max_bytes=3 * weight, live=True)
        talker.hold_admission = True
        lone = calls.open(_request("lone"), GenerateOptions())
        while not talker.calls:
            await asyncio.sleep(0)
        streams = [calls.open(request, GenerateOptions()) for request in heavy]
        talker.calls[0].messages.put_nowait([CallItem("lone", Admitted("lone"))])
        admitted = 1
        while sum(len(c.request_ids) for c in talker.calls) < 8:  # each call admitted in turn: the next one leaves
            for call in talker.calls[admitted:]:
                call.messages.put_nowait([CallItem(r, Admitted(r)) for r in call.request_ids])
            admitted = len(talker.calls)
            await asyncio.sleep(0)
        for stream in [lone, *streams]:
            stream.cancel()

    asyncio.run(run())
    assert [len(c.request_ids) for c in talker.calls] == [1, 3, 3, 1]


class _Unpicklable(Exception):
    def __init__(self, message: str):
        super().__init__(message)
        self.lock = threading.Lock()


class _NeedsTwo(Exception):  # pickles, but does not unpickle (its __init__ takes two arguments)
    def __init__(self, a: str, b: str):
        super().__init__(f"{a} {b}")


def test_an_error_that_does_not_pickle_ends_its_request_alone():
    """The Talker sends a request's error inside a message with other requests' items: one that cannot be pickled
    and unpickled goes as a RuntimeError naming it, so the message (and the other requests) still go."""
    kept = CallItem.failed("a", InvalidRequestError("no such voice"))
    assert isinstance(kept.error, InvalidRequestError)
    items = [kept, CallItem.failed("b", _Unpicklable("engine gone")), CallItem.failed("c", _NeedsTwo("x", "y")),
             CallItem("d", Admitted("d"))]
    message = pickle.loads(pickle.dumps(items))
    assert isinstance(message[0].error, InvalidRequestError)
    assert type(message[1].error) is RuntimeError and str(message[1].error) == "_Unpicklable: engine gone"
    assert type(message[2].error) is RuntimeError and str(message[2].error) == "_NeedsTwo: x y"
    assert message[3].item == Admitted("d")


def test_speech_requests_go_in_generate_many_calls_and_close_their_boxes_when_read(talker):
    """Speech requests batch as live ones do, in `generate_many` calls; each request's box closes once its reader
    stops, whether it ended (so the mailbox keeps no box of it) or left early (the Talker aborts it alone: its call
    goes on for the others)."""
    closed: list[str] = []

    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, close_box=closed.append)
        first = calls.open(_request("s0"), GenerateOptions())
        await asyncio.sleep(0)
        rest = [calls.open(_request(f"s{i}"), GenerateOptions()) for i in (1, 2)]
        while len(talker.calls) < 2:
            await asyncio.sleep(0)
        assert [(c.method, c.request_ids) for c in talker.calls] == [("generate_many", ["s0"]),
                                                                     ("generate_many", ["s1", "s2"])]
        assert await anext(first) == Admitted("s0")
        talker.calls[0].messages.put_nowait(_last("s0", 0))
        assert _key(await anext(first)) == ("s0", 0, True)
        with pytest.raises(StopAsyncIteration):
            await anext(first)
        first.cancel()
        first.cancel()  # a reader's cleanup may run twice: the box closes once
        assert closed == ["s0"]
        assert await anext(rest[0]) == Admitted("s1")
        rest[0].cancel()  # left before its end
        assert closed == ["s0", "s1"] and not talker.calls[1].cancelled  # s2 still reads
        talker.calls[1].messages.put_nowait(_last("s2", 0))
        items = await _read(rest[1])
        rest[1].cancel()
        return items

    assert asyncio.run(run()) == [("admitted", "s2"), ("s2", 0, True)]
    assert closed == ["s0", "s1", "s2"]


def test_a_request_a_full_replica_refused_goes_again_in_a_later_batch(talker):
    """A speech request refused with `ReplicaFullError` is sent again after `retry_after_s` (Serve may route that
    call to another replica) and reads its items from that call; at most `max_retrying` wait so, and the next
    refusal is the request's answer; a request cancelled while it waits is not sent."""

    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=5.0, close_box=lambda _: None,
                            max_retrying=2, retry_after_s=0.01)
        talker.hold_admission = True
        streams = {r: calls.open(_request(r), GenerateOptions()) for r in ("a", "b", "c", "d")}
        await asyncio.sleep(0)
        first = talker.calls[0]
        assert first.request_ids == ["a", "b", "c", "d"]
        talker.hold_admission = False  # the later calls are admitted at once
        full = ReplicaFullError("full")
        first.messages.put_nowait([CallItem("a", Admitted("a")), *(CallItem.failed(r, full) for r in "bcd")])
        assert await anext(streams["a"]) == Admitted("a")
        with pytest.raises(ReplicaFullError):  # the third refusal: two already wait
            await anext(streams["d"])
        streams["c"].cancel()  # its client left while it waited
        calls.open(_request("e"), GenerateOptions())  # started meanwhile: goes at once
        while len(talker.calls) < 3:
            await asyncio.sleep(0.005)
        again = talker.calls[2]
        again.messages.put_nowait(_last("b", 0))  # after its admission, sent by the call itself
        again.messages.put_nowait(None)
        return [c.request_ids for c in talker.calls], await _read(streams["b"])

    ids, b = asyncio.run(run())
    assert ids == [["a", "b", "c", "d"], ["e"], ["b"]]
    assert b == [("admitted", "b"), ("b", 0, True)]


def test_a_request_sent_again_still_counts_as_waiting_until_a_replica_admits_it(talker):
    """The bound on waiting requests holds while one of them is on its way again: with `max_retrying` 1, a request
    refused while the first waiter's second call is still unanswered is refused for good (a 429), and the waiter
    refused again keeps its place."""

    async def run():
        calls = TalkerCalls(talker, "mailbox", max_batch=32, admission_wait_s=0.01, close_box=lambda _: None,
                            max_retrying=1, retry_after_s=0.01)
        talker.hold_admission = True  # every call's answer comes when the test sends it
        full = ReplicaFullError("full")
        waiter = calls.open(_request("w"), GenerateOptions())
        await asyncio.sleep(0)
        talker.calls[0].messages.put_nowait([CallItem.failed("w", full)])
        while len(talker.calls) < 2:  # sent again after retry_after_s: that call is not answered yet
            await asyncio.sleep(0.005)
        late = calls.open(_request("late"), GenerateOptions())
        while len(talker.calls) < 3:
            await asyncio.sleep(0.005)
        assert [c.request_ids for c in talker.calls] == [["w"], ["w"], ["late"]]
        talker.calls[2].messages.put_nowait([CallItem.failed("late", full)])
        with pytest.raises(ReplicaFullError):  # "w" still waits: the bound is full (else "late" waits too)
            await asyncio.wait_for(anext(late), 30)
        talker.calls[1].messages.put_nowait([CallItem.failed("w", full)])  # refused again: it keeps waiting
        while len(talker.calls) < 4:
            await asyncio.sleep(0.005)
        talker.calls[3].messages.put_nowait([CallItem("w", Admitted("w")), *_last("w", 0)])
        items = await _read(waiter)
        return items, calls._seeking_slot

    items, seeking = asyncio.run(run())
    assert items == [("admitted", "w"), ("w", 0, True)]
    assert not seeking  # admitted: it no longer counts
