"""The engine hands a frame out as soon as its step's first half (the code predictor) is done, before the talker half
(stages/talker/step_copies.py), against the fake runner of test_talker_engine_loop.py."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from stages.chunking import ChunkSchedule
from stages.contract import FinishReason, SynthesisRequest
from stages.talker.engine import TalkerEngine, TalkerEngineConfig
from tests.stages import test_talker_engine_loop as loop
from tests.stages.test_talker_engine_loop import FakeRunner, frame_codes

model, prompt = loop.model, loop.prompt  # the loop tests' fixtures: the tiny model (fp32) and its prompt


class HeldStepRunner(FakeRunner):
    """A step's whole output (the next frame's codebook 0) is held back until the test releases it; its frame codes
    (the code predictor's half of the step) are there at once."""

    released = threading.Event()

    def step_output(self, turn: int, n: int) -> np.ndarray:
        assert self.released.wait(60), "the test never released the step's second half"
        return super().step_output(turn, n)


def test_a_frame_is_handed_out_before_its_step_finishes_and_the_chunks_are_unchanged(model, prompt):
    """The first chunk (one frame) reaches the stream while the step that made it is still held (its talker half:
    the next codebook 0): it comes from the frame's codes alone. Released, the stream gets the same chunks as when
    both halves are read at once, its final chunk empty when EOS follows a chunk boundary."""
    schedule = ChunkSchedule(first_chunk_frames=1, steady_chunk_frames=2, left_context_frames=1, ramp=())
    HeldStepRunner.released.clear()
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, max_num_seqs=2,
                                                    kernels={"exact_prefill": False}), HeldStepRunner)
    engine.start(log=lambda _m: None)
    try:
        async def main():
            stream = engine.add_request(SynthesisRequest("g", prompt, max_frames=9, seed=3005), schedule)
            it = stream.__aiter__()
            first = await asyncio.wait_for(it.__anext__(), 60)  # not released: only the frame's codes are read
            assert not HeldStepRunner.released.is_set()
            HeldStepRunner.released.set()
            return [first] + [c async for c in it]
        chunks = asyncio.run(main())
        codes_read, launches = list(engine.runner.codes_read), engine.runner.launches
    finally:
        HeldStepRunner.released.set()
        engine.shutdown()
    # seed 3005: codebook 0 is EOS after frame 3, so frames 0-2 (chunks of 1 and 2 frames), then an empty final one
    assert [c.num_new for c in chunks] == [1, 2, 0]
    assert [c.final for c in chunks] == [False, False, True] and chunks[-1].finish_reason is FinishReason.EOS
    frames = np.concatenate([c.codes[c.context:] for c in chunks])
    np.testing.assert_array_equal(frames, np.stack([frame_codes(3005, f) for f in range(3)]))
    assert len(codes_read) == launches >= 3  # each step's codes were read before its whole output
