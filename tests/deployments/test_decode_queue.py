"""DecodeQueue: earliest playback deadline first, bounded engine calls, streams in order and forgotten."""

import numpy as np
import pytest

from deployments.decode_queue import FRAME_S, DecodeQueue
from stages.contract import NUM_CODEBOOKS, CodecChunk


def chunk(rid: str, seq: int, new: int, context: int = 0, final: bool = False) -> CodecChunk:
    return CodecChunk(rid, seq, np.zeros((context + new, NUM_CODEBOOKS), dtype=np.int64), context, final)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_chunk_is_due_when_its_streams_earlier_audio_has_played():
    clock = Clock()
    q = DecodeQueue(max_call_frames=10_000, clock=clock)
    assert q.push(chunk("a", 0, 1), "a0") == 0.0  # a stream's first chunk is due on arrival
    clock.now = 0.05
    assert q.push(chunk("a", 1, 2, context=1), "a1") == pytest.approx(1 * FRAME_S)
    assert q.push(chunk("a", 2, 4, context=3), "a2") == pytest.approx(3 * FRAME_S)
    assert q.push(chunk("b", 0, 1), "b0") == 0.05
    assert q.take() == ["a0", "b0", "a1", "a2"]


def test_a_new_streams_first_chunk_overtakes_steady_chunks_queued_before_it():
    clock = Clock()
    q = DecodeQueue(max_call_frames=60, clock=clock)
    for seq in range(3):  # stream "s" is seconds ahead of its listener
        q.push(chunk("s", seq, 25, context=25 if seq else 0), f"s{seq}")
    clock.now = 1.0
    q.push(chunk("n", 0, 1), "n0")
    assert q.take() == ["s0", "n0"]  # s0 is due at 0; n0 at 1.0, before s1 (at 2.0)
    assert q.take() == ["s1"]  # 50 frames: the next one would pass 60
    assert q.take() == ["s2"] and len(q) == 0


def test_a_call_takes_at_least_one_chunk_however_long():
    q = DecodeQueue(max_call_frames=4, clock=Clock())
    q.push(chunk("a", 0, 50), "long")
    q.push(chunk("b", 0, 1), "short")
    assert q.take() == ["long"]
    assert q.take() == ["short"]
    assert q.take() == []


def test_the_cost_function_sizes_the_calls():
    q = DecodeQueue(max_call_frames=2, cost=lambda c: c.num_new, clock=Clock())  # context not decoded
    q.push(chunk("a", 0, 1, context=25), "a")
    q.push(chunk("b", 0, 1, context=25), "b")
    q.push(chunk("c", 0, 1, context=25), "c")
    assert q.take() == ["a", "b"]


def test_a_final_chunk_forgets_its_stream_and_streams_are_bounded():
    clock = Clock()
    q = DecodeQueue(max_call_frames=100, max_streams=2, clock=clock)
    q.push(chunk("a", 0, 2), 0)
    q.push(chunk("a", 1, 2, final=True), 1)
    clock.now = 5.0
    assert q.push(chunk("a", 0, 2), 2) == 5.0  # the same id again is a new stream
    q.push(chunk("b", 0, 2), 3)
    q.push(chunk("c", 0, 2), 4)  # a third open stream: the least recently seen ("a") is forgotten
    clock.now = 9.0
    assert q.push(chunk("b", 1, 2), 5) == pytest.approx(5.0 + 2 * FRAME_S)  # remembered
    assert q.push(chunk("a", 1, 2), 6) == 9.0  # not remembered: treated as a stream starting now


def test_limits_are_checked():
    with pytest.raises(ValueError):
        DecodeQueue(max_call_frames=0)
