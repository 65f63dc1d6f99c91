"""Live text cannot hold the Talker's rows hostage (CPU, the real engine): a parked live request gives its slot
to waiting non-live work once it has waited for text `live_evict_parked_s`, and a live request still waiting for
text past `live_max_lifetime_s` ends; both with `LiveTextEvictedError`, the frames made so far delivered first."""

from __future__ import annotations

import asyncio

import pytest

from stages.contract import InvalidRequestError, LiveTextEvictedError, SynthesisRequest, TextTimeoutError
from stages.prompts import build_prompt
from tests.stages.test_talker_live_text import GREEDY, _codes, _engine, _prompts, _until, cv  # noqa: F401 (fixture)


def test_waiting_work_evicts_the_longest_parked_live_request(cv):  # noqa: F811
    live, _ = _prompts(cv, "cv")
    other = build_prompt(cv.config, cv.tokenizer, "Hello.", speaker="ryan", language="english")
    with _engine(cv, max_num_seqs=2, text_idle_timeout_s=600.0, live_evict_parked_s=0.0) as engine:
        async def main():
            first = engine.open_request(SynthesisRequest("first", live, GREEDY, 40), text="Hello there, ")
            await _until(lambda: "first" in engine.scheduler.parked)
            second = engine.open_request(SynthesisRequest("second", live, GREEDY, 40), text="Good day, ")
            await _until(lambda: "second" in engine.scheduler.parked)
            # both slots parked: a plain request waits, then takes the slot of the one parked longest
            plain = engine.add_request(SynthesisRequest("plain", other, GREEDY, 6))
            with pytest.raises(LiveTextEvictedError, match="waited"):
                await _codes(first)
            plain_codes = await _codes(plain)
            assert "second" in engine.scheduler.parked  # the other live request keeps its slot
            engine.append_text("second", "friend.")
            engine.end_text("second")
            return plain_codes, await _codes(second)
        plain_codes, second_codes = asyncio.run(main())
        stats = engine.stats()
    assert len(plain_codes) == 6 and len(second_codes) > 0
    assert stats.live_evictions == 1 and stats.parked == stats.running == 0 and stats.kv_reserved_tokens == 0


def test_a_live_request_is_not_evicted_before_it_has_waited_its_grace(cv):  # noqa: F811
    live, _ = _prompts(cv, "cv")
    other = build_prompt(cv.config, cv.tokenizer, "Hello.", speaker="ryan", language="english")
    with _engine(cv, max_num_seqs=1, text_idle_timeout_s=600.0, live_evict_parked_s=600.0) as engine:
        async def main():
            talk = engine.open_request(SynthesisRequest("talk", live, GREEDY, 40), text="Hello there, ")
            await _until(lambda: "talk" in engine.scheduler.parked)
            plain = engine.add_request(SynthesisRequest("plain", other, GREEDY, 6))
            await _until(lambda: engine.stats().waiting == 1)
            for _ in range(20):  # many loop iterations: the plain request keeps waiting, nobody is evicted
                await asyncio.wrap_future(engine.run_on_device(lambda: None))
            assert "talk" in engine.scheduler.parked and engine.stats().live_evictions == 0
            engine.append_text("talk", "friend.")
            engine.end_text("talk")
            return await _codes(talk), await _codes(plain)
        talk_codes, plain_codes = asyncio.run(main())
    assert len(talk_codes) > 0 and len(plain_codes) == 6


def test_a_live_request_waiting_past_its_lifetime_ends(cv):  # noqa: F811
    live, _ = _prompts(cv, "cv")
    with _engine(cv, max_num_seqs=2, text_idle_timeout_s=600.0, live_max_lifetime_s=0.5) as engine:
        async def main():
            stream = engine.open_request(SynthesisRequest("old", live, GREEDY, 40), text="Hello there, ")
            with pytest.raises(LiveTextEvictedError, match="lifetime") as err:
                await _codes(stream)
            assert isinstance(err.value, TextTimeoutError)  # clients that know the idle timeout's error know this
        asyncio.run(main())
        stats = engine.stats()
    assert stats.live_evictions == 1 and stats.parked == stats.held == 0 and stats.kv_reserved_tokens == 0


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
