"""The talker scheduler alone (no model, no torch): admission by rows and KV blocks, FIFO, moves, aborts."""

from __future__ import annotations

import numpy as np

from stages.contract import SynthesisRequest, TalkerPrompt
from stages.talker.scheduler import RowMove, Scheduler, Sequence

PROMPT = TalkerPrompt(text_ids=(1, 2, 3), language_id=None)


def seq(name: str, prompt_len: int = 14, max_frames: int = 16) -> Sequence:
    return Sequence(SynthesisRequest(name, PROMPT, max_frames=max_frames), seed=0, prompt_len=prompt_len,
                    trailing_len=3, output=None)


def test_admission_reserves_the_blocks_of_each_requests_own_bound():
    s = Scheduler(max_num_seqs=8, num_blocks=10, block_size=16, max_prefill_batch=8, max_waiting=100)
    short, long = seq("short", 14, 16), seq("long", 14, 100)  # 32 and 116 positions: 2 and 8 blocks
    s.add(short)
    s.add(long)
    assert s.admit() == [short, long]
    assert len(short.blocks) == 2 and len(long.blocks) == 8 and s.blocks.free == 0
    assert s.reserved_positions == 160
    assert not set(short.blocks) & set(long.blocks)


def test_fifo_head_waits_for_blocks_and_is_not_overtaken():
    s = Scheduler(max_num_seqs=8, num_blocks=4, block_size=16, max_prefill_batch=8, max_waiting=100)
    a, big, small = seq("a", 14, 16), seq("big", 14, 40), seq("small", 14, 16)
    for x in (a, big, small):
        s.add(x)
    assert s.admit() == [a]  # big needs 4 blocks, 2 are free; small must not overtake it
    assert list(s.waiting) == [big, small]
    s.release([a])
    assert s.admit() == [big]


def test_rows_stay_dense_and_release_moves_the_last_row_into_the_hole():
    s = Scheduler(max_num_seqs=4, num_blocks=100, block_size=16, max_prefill_batch=4, max_waiting=100)
    seqs = [seq(f"r{i}") for i in range(4)]
    for x in seqs:
        s.add(x)
    s.admit()
    assert [x.row for x in seqs] == [0, 1, 2, 3]
    moves = s.release([seqs[0], seqs[3]])  # the last row goes without a move; row 2 fills the hole at 0
    assert moves == [RowMove(2, 0)]
    assert [x.request_id for x in s.running] == ["r2", "r1"] and seqs[2].row == 0
    assert s.blocks.free == 100 - 2 * 2


def test_each_survivor_moves_at_most_once():
    """Holes low and high at once (rows 1 and 4 of 6 leave): rows 5 and ... fill them, none moves twice."""
    s = Scheduler(max_num_seqs=6, num_blocks=100, block_size=16, max_prefill_batch=6, max_waiting=100)
    seqs = [seq(f"r{i}") for i in range(6)]
    for x in seqs:
        s.add(x)
    s.admit()
    moves = s.release([seqs[4], seqs[1]])
    assert moves == [RowMove(5, 1)]  # row 4 is past the new end: it just goes
    assert [x.request_id for x in s.running] == ["r0", "r5", "r2", "r3"]
    assert [x.row for x in s.running] == [0, 1, 2, 3]
    assert len({m.src for m in moves}) == len(moves) and all(m.src >= len(s.running) for m in moves)


def test_prefill_batch_and_rows_bound_admission():
    s = Scheduler(max_num_seqs=3, num_blocks=100, block_size=16, max_prefill_batch=2, max_waiting=100)
    for i in range(5):
        s.add(seq(f"r{i}"))
    assert len(s.admit()) == 2 and len(s.admit()) == 1 and s.admit() == []
    assert s.num_running == 3 and s.num_waiting == 2


def test_abort_while_waiting_leaves_the_queue_at_once():
    s = Scheduler(max_num_seqs=1, num_blocks=100, block_size=16, max_prefill_batch=1, max_waiting=100)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.add(b)
    s.admit()
    assert s.abort("b") is b and b.row < 0 and s.num_waiting == 0
    assert s.abort("b") is None  # once
    assert s.abort("a") is a and not s.live[a.ticket]  # running: no longer live, released by the engine


def test_tickets_change_generation_when_reused():
    s = Scheduler(max_num_seqs=1, num_blocks=100, block_size=16, max_prefill_batch=1, max_waiting=100)
    a, b = seq("a"), seq("b")
    s.add(a)
    s.admit()
    ticket, gen = a.ticket, int(s.generation[a.ticket])
    s.release([a])
    s.add(b)
    s.admit()
    assert b.ticket == ticket and s.generation[ticket] != gen  # a step launched for `a` cannot be read as `b`'s
    assert np.array_equal(s.frames[[ticket]], [0])


def test_parked_requests_leave_the_rows_and_keep_slot_and_kv():
    """Live text: a parked request leaves the dense rows (the last row fills its hole), keeps its ticket and
    blocks, still counts against max_num_seqs, and comes back at the end of the rows."""
    s = Scheduler(max_num_seqs=3, num_blocks=100, block_size=16, max_prefill_batch=3, max_waiting=100)
    a, b, c, d = (seq(x) for x in "abcd")
    for x in (a, b, c, d):
        s.add(x)
    s.admit()
    ticket, blocks = a.ticket, a.blocks
    assert s.park([a]) == [RowMove(2, 0)]
    assert [x.row for x in s.running] == [0, 1] and c.row == 0 and a.row == -1
    assert a.ticket == ticket and a.blocks is blocks and s.num_parked == 1 and s.blocks.free == 100 - 6
    assert s.admit() == []  # 2 running + 1 parked: the slots are full, d waits
    assert s.unpark(a) == 2 and s.running[2] is a and s.num_parked == 0
    s.park([b])
    moves = s.release([b])  # a parked request releases without any row move
    assert moves == [] and s.blocks.free == 100 - 4 and s.num_parked == 0
    assert s.admit() == [d]


def test_held_requests_take_nothing_until_enqueued():
    s = Scheduler(max_num_seqs=1, num_blocks=100, block_size=16, max_prefill_batch=1, max_waiting=100)
    h, w = seq("h"), seq("w")
    s.hold(h)
    s.add(w)
    assert s.admit() == [w] and s.num_held == 1
    s.release([w])
    s.enqueue(h)
    assert s.admit() == [h] and s.num_held == 0
    held = seq("x")
    s.hold(held)
    assert s.abort("x") is held and s.num_held == 0 and s.get("x") is None


def test_restarts_are_admitted_before_the_queue_in_their_own_slot():
    """Between two segments a request is parked for a new prefill: requeued, it takes a row before the queue,
    without new blocks or ticket; its frame count and ticket survive, its generation changes."""
    s = Scheduler(max_num_seqs=2, num_blocks=100, block_size=16, max_prefill_batch=2, max_waiting=100)
    a, b, q = seq("a"), seq("b"), seq("q")
    for x in (a, b):
        s.add(x)
    s.admit()
    s.frames[a.ticket] = 7
    ticket, gen, free = a.ticket, int(s.generation[a.ticket]), s.blocks.free
    s.park([a], restart=True)
    s.add(q)
    assert s.admit() == []  # a still holds its slot
    s.requeue(a)
    assert s.admit() == [a] and a.row == 1 and not a.restart
    assert a.ticket == ticket and s.frames[ticket] == 7 and s.generation[ticket] != gen and s.blocks.free == free
    s.park([a], restart=True)
    s.requeue(a)
    s.release([a])  # aborted while requeued: it leaves the restarts too
    assert not s.restarts and s.admit() == [q]


def _parked_live(s: Scheduler, names: str, since: dict[str, float]) -> list[Sequence]:
    """Live requests admitted, then parked waiting for text since `since[name]`."""
    from stages.talker.live_text import LiveText

    seqs = [seq(x) for x in names]
    for x in seqs:
        x.live = LiveText(PROMPT, 0, last_text_at=0.0, idle_timeout_s=30.0, waiting_since=since[x.request_id])
        s.add(x)
    s.admit()
    s.park(seqs)
    return seqs


def test_parked_live_requests_keep_only_their_share_while_others_wait():
    """Live text cannot hold the rows hostage: with the slots full and a request waiting, the longest-parked live
    request is named to make room until those parked keep no more than their share; none while nothing waits."""
    s = Scheduler(max_num_seqs=4, num_blocks=100, block_size=16, max_prefill_batch=4, max_waiting=100)
    a, b, c = _parked_live(s, "abc", {"a": 5.0, "b": 1.0, "c": 3.0})
    s.add(runner := seq("r"))
    assert s.admit() == [runner]  # a free slot: nothing is evicted
    assert s.parked_over_share(0.5) is None
    s.add(seq("w"))  # now the slots are full (1 running + 3 parked) and w waits
    assert s.parked_over_share(0.5) is b  # parked longest
    s.release([b])
    assert s.parked_over_share(0.5) is None  # a free slot again
    s.admit()
    s.add(seq("w2"))
    assert s.parked_over_share(0.5) is None  # 2 of 4 slots parked: within the share, w2 waits for a runner
    assert s.parked_over_share(0.25) is c
    assert s.parked_over_share(1.0) is None


def test_parked_live_requests_make_room_for_kv_and_when_nothing_runs():
    s = Scheduler(max_num_seqs=8, num_blocks=6, block_size=16, max_prefill_batch=8, max_waiting=100)
    a, b = _parked_live(s, "ab", {"a": 2.0, "b": 1.0})  # 2 blocks each: 4 of 6 blocks parked, no runner
    s.add(seq("big", 14, 40))  # needs 4 blocks, 2 free
    assert s.parked_over_share(1.0) is b  # nothing runs: only a parked request can free anything
    s.add(runner := seq("r0"))
    s.waiting.rotate(1)  # r0 first: it fits and runs
    assert s.admit() == [runner]
    assert s.parked_over_share(0.5) is b  # 4 of 6 blocks parked, over half, and big does not fit
    assert s.parked_over_share(0.7) is None
    b.live.waiting_since = None  # between segments with its next one ready: about to run, not idle
    assert s.parked_over_share(0.1) is a
