"""deployments/text_mailbox.py and deployments/talker/text_pump.py on a real Ray cluster: events in order,
a waiting poll wakes on put, close and claim; one Talker-side pump feeds several requests from one mailbox."""

from __future__ import annotations

import asyncio

import pytest

from deployments import first_audio_timing
from deployments.talker.text_pump import LiveTextPump
from deployments.text_mailbox import MailboxWriter, TextEvent, new_mailbox
from stages.contract import InvalidRequestError

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def mailbox(ray_cluster):
    import ray

    box = new_mailbox()
    yield box
    ray.kill(box)


def test_events_arrive_in_order_and_a_poll_waits_for_them(mailbox):
    async def run():
        waiting = asyncio.ensure_future(mailbox.take_many.remote("t1", ["r1"]))  # nothing queued yet: it waits
        await asyncio.sleep(0)
        assert not waiting.done()
        for i in range(20):  # one call each, as the ingress sends them
            assert await mailbox.put.remote("r1", [TextEvent("append", f"w{i} ")])
        events = (await waiting)["r1"]
        while len(events) < 20:
            events += (await mailbox.take_many.remote("t1", ["r1"]))["r1"]
        await mailbox.put.remote("r1", [TextEvent("flush"), TextEvent("end")])
        return events, await mailbox.take_many.remote("t1", ["r1"])

    events, tail = asyncio.run(run())
    assert [e.text for e in events] == [f"w{i} " for i in range(20)]
    assert list(tail) == ["r1"] and [e.kind for e in tail["r1"]] == ["flush", "end"]


def test_the_ingress_puts_of_many_contexts_go_in_few_calls_each_context_in_order(mailbox):
    """`MailboxWriter`: 40 contexts putting words at once (each awaiting its put before the next, as the ingress
    does) make a few `put_many` calls, not 200; every context's words arrive in order; their 40 closes go in the
    next call, ahead of a later put, which its closed box refuses."""
    async def run():
        writer = MailboxWriter(mailbox)
        calls = []
        real = writer._puts._run  # its batches' one call each

        async def counted(items):
            calls.append(len(items))
            return await real(items)

        writer._puts._run = counted

        async def context(k: int) -> None:
            for i in range(5):
                assert await writer.put(f"w{k}", [TextEvent("append", f"{k}.{i} ")])

        await asyncio.gather(*(context(k) for k in range(40)))
        words = list(calls)
        taken = await mailbox.take_many.remote("tw", [f"w{k}" for k in range(40)])
        for k in range(40):
            writer.close(f"w{k}")
        refused = await writer.put("w0", [TextEvent("append", "late")])
        return words, calls[len(words):], taken, refused

    calls, closing, taken, refused = asyncio.run(run())
    assert sum(calls) == 200 and len(calls) <= 20, calls  # each round of 40 puts in one or two calls
    assert closing == [41]  # the closes and the late put: one call
    assert {rid: [e.text for e in events] for rid, events in taken.items()} == {
        f"w{k}": [f"{k}.{i} " for i in range(5)] for k in range(40)}
    assert refused is False


def test_one_poll_returns_every_request_with_text_and_only_those(mailbox):
    async def run():
        await mailbox.put.remote("a", [TextEvent("append", "x")])
        await mailbox.put.remote("c", [TextEvent("append", "y"), TextEvent("append", "z")])
        return await mailbox.take_many.remote("t2", ["a", "b", "c"])

    taken = asyncio.run(run())
    assert {rid: [e.text for e in events] for rid, events in taken.items()} == {"a": ["x"], "c": ["y", "z"]}


def test_close_and_claim_end_a_waiting_poll(mailbox):
    """A close ends a waiting poll with [] for its request (later puts refused); a claim adds a request to a poll
    that waits already, which returns once that request has text (no poll restarts per new request); a request
    neither put nor closed yet waits; `release` ends a poll with {}."""
    async def run():
        before = await mailbox.open_boxes.remote()
        waiting = asyncio.ensure_future(mailbox.take_many.remote("t3", ["r2"]))
        await mailbox.close.remote("r2")
        closed = await waiting
        accepted = await mailbox.put.remote("r2", [TextEvent("append", "late")])
        waiting = asyncio.ensure_future(mailbox.take_many.remote("t3", ["r3"]))  # r3: no text yet
        await mailbox.claim_many.remote("t3", ["r4", "r5"])  # requests that arrived while the poll waits
        await asyncio.sleep(0.2)
        still_waiting = not waiting.done()
        await mailbox.put.remote("r4", [TextEvent("append", "four")])
        took = await waiting
        waiting = asyncio.ensure_future(mailbox.take_many.remote("t3", []))  # claimed ones stay claimed
        await mailbox.put.remote("r5", [TextEvent("append", "five")])
        took5 = await waiting
        waiting = asyncio.ensure_future(mailbox.take_many.remote("t3", []))
        await mailbox.release.remote("t3")
        released = await waiting
        for rid in ("r3", "r4", "r5"):
            await mailbox.close.remote(rid)
        late_claim = await mailbox.take_many.remote("t3b", ["r4"])  # claimed after its close: [] at once
        return closed, accepted, still_waiting, took, took5, released, late_claim, before, \
            await mailbox.open_boxes.remote()

    closed, accepted, still_waiting, took, took5, released, late_claim, before, boxes = asyncio.run(run())
    assert closed == {"r2": []} and accepted is False  # r2's box is gone: [] for it, later puts refused
    assert still_waiting  # a claim alone (no text) does not end the poll
    assert {rid: [e.text for e in ev] for rid, ev in took.items()} == {"r4": ["four"]}
    assert {rid: [e.text for e in ev] for rid, ev in took5.items()} == {"r5": ["five"]}
    assert released == {} and late_claim == {"r4": []} and boxes == before


def test_a_poll_or_claim_after_its_takers_release_ends_at_once(mailbox):
    """A pump's last poll may reach the mailbox after its release (both are sent as it stops): it returns {} at once,
    as does a late claim, and neither leaves the taker's key or claims behind (no waiter held forever)."""
    async def run():
        before = await mailbox.takers.remote()
        await mailbox.put.remote("r9", [TextEvent("append", "nine")])
        await mailbox.release.remote("t9")
        late_poll = await asyncio.wait_for(mailbox.take_many.remote("t9", ["r9"]), 30)
        await mailbox.claim_many.remote("t9", ["r9"])
        takers = await mailbox.takers.remote()
        kept = await mailbox.take_many.remote("t10", ["r9"])  # the text stays for a live taker
        await mailbox.close.remote("r9")
        await mailbox.release.remote("t10")
        return before, late_poll, takers, kept

    before, late_poll, takers, kept = asyncio.run(run())
    assert late_poll == {} and takers == before
    assert {rid: [e.text for e in ev] for rid, ev in kept.items()} == {"r9": ["nine"]}


class _Engine:
    """The engine's text side as the pump calls it: what each request received, in order."""

    def __init__(self):
        self.received: dict[str, list[str]] = {}
        self.ended_requests: set[str] = set()
        self.changed = asyncio.Event()

    def _note(self, request_id: str, what: str) -> None:
        if request_id in self.ended_requests:
            raise InvalidRequestError(f"request {request_id!r} has ended")
        self.received.setdefault(request_id, []).append(what)
        self.changed.set()

    def append_text(self, request_id, text):
        self._note(request_id, text)

    def flush_text(self, request_id):
        self._note(request_id, "<flush>")

    def end_text(self, request_id):
        self._note(request_id, "<end>")

    def abort(self, request_id):
        self._note(request_id, "<abort>")

    async def until(self, predicate) -> None:
        while not predicate():
            self.changed.clear()
            await asyncio.wait_for(self.changed.wait(), 60)


def test_one_pump_feeds_every_request_of_a_mailbox_in_order(mailbox):
    """A request added while the pump's poll waits for another's text gets its own text at once (the add claims it
    into the waiting poll); each request's events reach the engine in order; `end` and a closed box end a request's
    text; once its requests are gone the mailbox holds nothing of the pump (its memory stays bounded by the replicas
    polling)."""
    engine = _Engine()

    async def run():
        takers_before = await mailbox.takers.remote()
        pump = LiveTextPump(engine, mailbox)
        pump.add("p1")
        assert pump.first_text_at("p1") is None
        put_at = first_audio_timing.now()
        await mailbox.put.remote("p1", [TextEvent("append", "one")])
        await engine.until(lambda: engine.received.get("p1") == ["one"])
        first_p1 = pump.first_text_at("p1")  # when "one" reached the engine (a live first audio's stamp)
        assert first_p1 is not None and put_at <= first_p1 <= first_audio_timing.now()
        await mailbox.put.remote("p2", [TextEvent("append", "two")])  # the pump now waits on p1 alone
        pump.add("p2")
        await engine.until(lambda: "p2" in engine.received)
        for i in range(10):
            await mailbox.put.remote("p1", [TextEvent("append", f"a{i}")])
            await mailbox.put.remote("p2", [TextEvent("append", f"b{i}")])
        await mailbox.put.remote("p1", [TextEvent("flush"), TextEvent("end"), TextEvent("append", "after end")])
        await mailbox.close.remote("p2")  # the ingress ended p2's context: the engine aborts it
        await engine.until(lambda: engine.received["p2"][-1] == "<abort>" and engine.received["p1"][-1] == "<end>")
        assert pump.requests == frozenset()  # both ended here: the pump stopped polling
        assert pump.first_text_at("p1") == first_p1  # its first text's, not a later one's
        pump.remove("p1")  # as the server does when their streams close: the mailbox forgets the pump
        pump.remove("p2")
        assert pump.first_text_at("p1") is None and pump.first_text_at("p2") is None  # nothing kept of them
        for _ in range(600):  # `release` is sent without waiting for it: until the mailbox has run it
            if await mailbox.takers.remote() == takers_before:
                break
            await asyncio.sleep(0.1)
        assert await mailbox.takers.remote() == takers_before

    asyncio.run(run())
    assert engine.received["p1"] == ["one", *(f"a{i}" for i in range(10)), "<flush>", "<end>"]
    assert engine.received["p2"] == ["two", *(f"b{i}" for i in range(10)), "<abort>"]


def test_the_burst_bench_times_every_first_text(ray_cluster):
    """`python -m bench.text_path_burst`'s measurement on the test cluster: each context's first text is timed."""
    from bench.text_path_burst import run

    out = asyncio.run(run([3], bursts=2))
    assert out["3"]["n"] == 6 and 0 < out["3"]["p50"] <= out["3"]["max"]
