"""Live text cannot hold the engine hostage (real engine, CPU): requests parked waiting for text keep only a share of
the slots while other requests wait (the longest-parked ends with `LiveTextEvictedError`), and trickled letters that
complete no token do not keep a request alive past its idle timeout."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from stages.contract import FinishReason, InvalidRequestError, LiveTextEvictedError, SynthesisRequest, TextTimeoutError
from stages.prompts import build_prompt
from stages.talker.engine_config import TalkerEngineConfig
from tests.stages.test_talker_live_text import GREEDY, _codes, _engine, _prompts, _until, _waiting, cv  # noqa: F401


def test_a_waiting_request_evicts_the_longest_parked_live_request(cv):  # noqa: F811
    """Two slots, both held by live requests parked for text that never comes: a plain request would wait for
    their idle timeout (10 minutes here). It ends the one parked longest (its frames so far delivered first), takes
    its slot and finishes; the other live request is untouched (within the share: 1 of 2 slots)."""
    live, _ = _prompts(cv, "cv")
    plain = build_prompt(cv.config, cv.tokenizer, "Plain request.", speaker="vivian", language="english")
    with _engine(cv, max_num_seqs=2, text_idle_timeout_s=600.0) as engine:
        async def main():
            first = engine.open_request(SynthesisRequest("first", live, GREEDY, 30), text="Hello there")
            await _until(lambda: _waiting(engine, "first") and "first" in engine.scheduler.parked)
            second = engine.open_request(SynthesisRequest("second", live, GREEDY, 30), text="Hello there")
            await _until(lambda: _waiting(engine, "second") and "second" in engine.scheduler.parked)
            frames: list[np.ndarray] = []
            with pytest.raises(LiveTextEvictedError, match="other requests needed its slot"):
                request = engine.add_request(SynthesisRequest("plain", plain, GREEDY, 8))
                async for chunk in first:
                    frames.append(chunk.codes[chunk.context:])
            codes = await _codes(request)
            still_open = engine.scheduler.get("second") is not None
            engine.end_text("second")
            return frames, first.finish_reason, codes, request.finish_reason, still_open, await _codes(second)
        frames, reason, codes, plain_reason, still_open, second_codes = asyncio.run(main())
        stats = engine.stats()
    assert reason is FinishReason.ERROR and sum(len(f) for f in frames) > 0  # spoke "Hello" before it waited
    assert plain_reason is FinishReason.LENGTH and len(codes) == 8
    assert still_open and len(second_codes) > 0
    assert stats.parked == stats.held == stats.running == 0 and stats.kv_reserved_tokens == 0


def test_letters_of_one_word_do_not_reset_the_idle_timeout(cv):  # noqa: F811
    """A client trickling the letters of one word never completes a token the engine could speak: the idle time
    runs on, and the request ends with `TextTimeoutError` although text keeps arriving."""
    live, _ = _prompts(cv, "cv")
    with _engine(cv, max_num_seqs=1, text_idle_timeout_s=3.0) as engine:
        async def main():
            stream = engine.open_request(SynthesisRequest("slow", live, GREEDY, 30), text="Hello ")
            ended = asyncio.create_task(_codes(stream))
            for _ in range(1500):  # a letter every 20 ms or more, for at least 10 times the timeout
                if ended.done():
                    break
                try:
                    engine.append_text("slow", "a")
                except InvalidRequestError:  # it ended between the check and the append
                    break
                await asyncio.sleep(0.02)
            assert ended.done(), "trickled letters kept the request alive"
            with pytest.raises(TextTimeoutError, match="no text for 3 s"):
                await ended
        asyncio.run(main())


def test_the_parked_share_is_validated():
    assert TalkerEngineConfig().live_parked_share == 0.5
    with pytest.raises(ValueError, match="live_parked_share"):
        TalkerEngineConfig(live_parked_share=1.5)
