"""deployments/ingress/text_mailbox.py on a real Ray cluster: events in order, a waiting take wakes on put and on close."""

from __future__ import annotations

import asyncio

import pytest

from deployments.ingress.text_mailbox import TextEvent, new_mailbox

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def mailbox(ray_cluster):
    import ray

    box = new_mailbox()
    yield box
    ray.kill(box)


def test_events_arrive_in_order_and_a_take_waits_for_them(mailbox):
    async def run():
        await mailbox.open.remote("r1")
        waiting = asyncio.ensure_future(mailbox.take.remote("r1"))  # nothing queued yet: it waits
        await asyncio.sleep(0)
        assert not waiting.done()
        for i in range(20):  # one call each, as the ingress sends them
            assert await mailbox.put.remote("r1", [TextEvent("append", f"w{i} ")])
        first = await waiting
        rest = []
        while len(first) + len(rest) < 20:
            rest += await mailbox.take.remote("r1")
        await mailbox.put.remote("r1", [TextEvent("flush"), TextEvent("end")])
        tail = await mailbox.take.remote("r1")
        return first + rest, tail

    events, tail = asyncio.run(run())
    assert [e.text for e in events] == [f"w{i} " for i in range(20)]
    assert [e.kind for e in tail] == ["flush", "end"]


def test_close_wakes_a_waiting_take_and_refuses_later_puts(mailbox):
    async def run():
        before = await mailbox.open_boxes.remote()
        await mailbox.open.remote("r2")
        waiting = asyncio.ensure_future(mailbox.take.remote("r2"))
        await mailbox.close.remote("r2")
        return await waiting, await mailbox.put.remote("r2", [TextEvent("append", "late")]), \
            await mailbox.take.remote("r2"), before, await mailbox.open_boxes.remote()

    taken, accepted, after, before, boxes = asyncio.run(run())
    assert taken == [] and accepted is False and after == [] and boxes == before  # r2's box is gone
