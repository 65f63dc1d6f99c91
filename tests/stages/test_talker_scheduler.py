"""The talker scheduler alone (no model, no torch): admission by rows and KV blocks, FIFO, moves, aborts, priority."""

from __future__ import annotations

import numpy as np
import pytest

from stages.contract import FRAME_SECONDS, Priority, SynthesisRequest, TalkerPrompt
from stages.talker.scheduler import RowMove, Scheduler, Sequence

PROMPT = TalkerPrompt(text_ids=(1, 2, 3), language_id=None)


def seq(name: str, prompt_len: int = 14, max_frames: int = 16, batch: bool = False) -> Sequence:
    priority = Priority.BATCH if batch else Priority.REALTIME
    return Sequence(SynthesisRequest(name, PROMPT, max_frames=max_frames, priority=priority), seed=0,
                    prompt_len=prompt_len, trailing_len=3, output=None)


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


# ---------------------------------------------------------------------------------------------- priority
def test_real_time_requests_are_admitted_before_batch_requests_queued_earlier():
    s = Scheduler(max_num_seqs=4, num_blocks=100, block_size=16, max_prefill_batch=4, max_waiting=100, batch_share=1.0)
    b1, b2, r = seq("b1", batch=True), seq("b2", batch=True), seq("r")
    for x in (b1, b2, r):
        s.add(x)
    assert s.num_waiting == 3 and s.num_waiting_batch == 2
    assert s.admit() == [r, b1, b2]  # the real-time request first; batch takes what is left, FIFO


def test_batch_requests_wait_while_a_real_time_request_waits():
    """The real-time head waits for KV blocks: a batch request that would fit must not take them."""
    s = Scheduler(max_num_seqs=8, num_blocks=6, block_size=16, max_prefill_batch=8, max_waiting=100, batch_share=1.0)
    running, big, small_batch = seq("a", 14, 16), seq("big", 14, 80), seq("b", 14, 16, batch=True)
    s.add(running)
    assert s.admit() == [running]  # 2 blocks of 6
    s.add(big)  # needs 6 blocks: waits for `running`
    s.add(small_batch)  # needs 2 blocks, 4 are free
    assert s.admit() == [] and list(s.waiting) == [big] and list(s.waiting_batch) == [small_batch]
    s.release([running])
    assert s.admit() == [big]
    s.release([big])
    assert s.admit() == [small_batch]


def test_batch_requests_take_at_most_their_share_of_rows_and_real_time_arrivals_find_the_rest():
    s = Scheduler(max_num_seqs=4, num_blocks=100, block_size=16, max_prefill_batch=4, max_waiting=100, batch_share=0.5)
    batch = [seq(f"b{i}", batch=True) for i in range(4)]
    for x in batch:
        s.add(x)
    assert s.admit() == batch[:2] and s.num_running_batch == 2  # two rows idle, kept for real-time work
    assert s.admit() == []
    realtime = [seq(f"r{i}") for i in range(3)]
    for x in realtime:
        s.add(x)
    assert s.admit() == realtime[:2]  # at once, without waiting for a batch request to end
    # demand rises: running batch requests are not preempted, waiting ones wait behind real-time ones
    s.release([batch[0]])
    assert s.admit() == [realtime[2]] and s.num_running_batch == 1
    s.release([realtime[0]])
    assert s.admit() == [batch[2]]  # no real-time request waits: the batch queue moves again


def test_batch_requests_take_at_most_their_share_of_kv_blocks():
    s = Scheduler(max_num_seqs=8, num_blocks=10, block_size=16, max_prefill_batch=8, max_waiting=100, batch_share=0.5)
    batch = [seq(f"b{i}", 14, 16, batch=True) for i in range(4)]  # 2 blocks each: 5 blocks allow two
    for x in batch:
        s.add(x)
    assert s.admit() == batch[:2] and s.blocks.free == 6
    huge = seq("huge", 14, 200, batch=True)  # needs more than the share alone: admitted when no batch runs
    s2 = Scheduler(max_num_seqs=8, num_blocks=20, block_size=16, max_prefill_batch=8, max_waiting=100,
                   batch_share=0.25)
    s2.add(huge)
    assert s2.admit() == [huge]


def test_batch_streams_never_count_in_the_admission_lead():
    """Nobody plays a batch stream: its audio handed out leaves `play_end` at inf, so it never holds back a burst."""
    s = Scheduler(max_num_seqs=4, num_blocks=100, block_size=16, max_prefill_batch=1, max_waiting=100, batch_share=1.0)
    b = seq("b", batch=True)
    s.add(b)
    s.admit()
    s.handed_out(b.ticket, 3, now=10.0)
    assert s.play_end[b.ticket] == np.inf and s.min_lead_s(10.0) == np.inf
    r = seq("r")
    s.add(r)
    s.admit()
    s.handed_out(r.ticket, 2, now=10.0)
    assert s.min_lead_s(10.0) == pytest.approx(2 * FRAME_SECONDS)
    for i in range(3):
        s.add(seq(f"x{i}"))
    # the real-time stream lacks lead: one prefill batch only; with the lead, a burst
    assert len(s.admit_for_step(lead_s=1.0, max_prefills=4, now=10.0)) == 1


def test_batch_requests_abort_and_drop_from_their_queue():
    s = Scheduler(max_num_seqs=2, num_blocks=100, block_size=16, max_prefill_batch=2, max_waiting=100, batch_share=0.5)
    running, waiting = seq("b0", batch=True), seq("b1", batch=True)
    s.add(running)
    s.add(waiting)
    assert s.admit() == [running]
    assert s.abort("b1") is waiting and s.num_waiting == 0
    s.add(seq("b2", batch=True))
    s.release([running])
    assert s.num_running_batch == 0
    assert [x.request_id for x in s.drop_all()] == ["b2"] and not s.waiting_batch


def test_one_prefill_batch_is_bounded_by_prompt_positions_as_well_as_requests():
    """`max_prefill_tokens`: short prompts (live text's) go many to one admission, long ones few; the head always
    goes (a prompt longer than the bound prefills alone), and the rest stays queued in order."""
    s = Scheduler(max_num_seqs=64, num_blocks=1000, block_size=16, max_prefill_batch=32, max_waiting=100,
                  max_prefill_tokens=100)
    short = [seq(f"s{i}", prompt_len=12) for i in range(10)]
    for x in short:
        s.add(x)
    assert s.admit() == short[:8]  # 8 x 12 = 96 positions; a 9th would make 108
    assert s.admit() == short[8:]
    long = [seq("huge", prompt_len=150), seq("l1", prompt_len=60), seq("l2", prompt_len=60)]
    for x in long:
        s.add(x)
    assert s.admit() == long[:1]  # alone over the bound: it still goes
    assert s.admit() == long[1:2] and s.admit() == long[2:]


@pytest.mark.parametrize("lacks_lead", [True, False])
def test_a_burst_admits_max_prefills_batches_of_prompt_positions(lacks_lead):
    """Lacking lead, one batch's positions; otherwise `max_prefills` batches' worth, shortest prompt first."""
    s = Scheduler(max_num_seqs=64, num_blocks=1000, block_size=16, max_prefill_batch=32, max_waiting=100,
                  max_prefill_tokens=100)
    playing = seq("playing")
    s.add(playing)
    s.admit()
    s.handed_out(playing.ticket, 1, now=0.0)  # 80 ms of audio out: it lacks a lead of 1 s
    burst = [seq(f"b{i}", prompt_len=20 - i) for i in range(17)]  # 20, 19, ..., 4 positions
    for x in burst:
        s.add(x)
    admitted = s.admit_for_step(lead_s=1.0 if lacks_lead else 0.0, max_prefills=2, now=0.0)
    # 20 + ... + 16 = 90 (a sixth makes 105 > 100); 20 + ... + 5 = 200 (a 17th makes 204 > 2 x 100)
    expect = burst[:5] if lacks_lead else burst[:16]
    assert admitted == sorted(expect, key=lambda x: x.prompt_len)
    assert list(s.waiting) == burst[len(expect):]


def test_lacking_lead_admits_what_one_prefill_holds():
    """While a playing stream lacks lead, an iteration admits no more than one prefill holds by the runner's
    padded bound (`prefill_fits`), so its step waits for one prefill, as before short prompts went many to one."""
    def fits(n: int, width: int) -> bool:  # a runner whose prefill pads prompts to >= 16 positions
        return n * max(width, 16) <= 64

    s = Scheduler(max_num_seqs=64, num_blocks=1000, block_size=16, max_prefill_batch=32, max_waiting=100,
                  max_prefill_tokens=100, prefill_fits=fits)
    playing = seq("playing")
    s.add(playing)
    s.admit()
    s.handed_out(playing.ticket, 1, now=0.0)
    burst = [seq(f"b{i}", prompt_len=10) for i in range(12)]
    for x in burst:
        s.add(x)
    assert s.admit_for_step(lead_s=1.0, max_prefills=2, now=0.0) == burst[:4]  # 4 x 16 padded (10 fit 100)
    assert s.admit_for_step(lead_s=0.0, max_prefills=2, now=0.0) == burst[4:12]  # with lead: 2 x 100 positions


def test_admitted_requests_go_in_prefills_that_fit_in_order():
    """`prefill_batches`: each prefill as large as `prefill_fits` allows (the batch's longest prompt sets its width),
    in the admitted order; without `prefill_fits`, `max_prefill_batch` at a time."""
    def fits(n: int, width: int) -> bool:
        return n * width <= 60

    s = Scheduler(max_num_seqs=8, num_blocks=100, block_size=16, max_prefill_batch=4, max_waiting=100,
                  prefill_fits=fits)
    a, b, c, d, e = (seq(x, prompt_len=n) for x, n in zip("abcde", (10, 12, 15, 30, 31), strict=True))
    assert s.prefill_batches([a, b, c, d, e]) == [[a, b, c], [d], [e]]  # 4 x 30 > 60; 2 x 31 > 60
    s.prefill_fits = None
    assert s.prefill_batches([a, b, c, d, e]) == [[a, b, c, d], [e]]
    assert s.prefill_batches([]) == []
