"""Live text through the real engine (CPU, fp32, greedy): text that arrives while the request runs.

Parity: a request fed token by token or character by character, with the engine stepping in between so that
it really waits (parked off the rows) before every piece, gives exactly the codes of the same text sent whole
in the streaming-text layout, which the oracle parity tests tie to the official package.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from stages.contract import (
    FinishReason,
    InvalidRequestError,
    SamplingParams,
    SynthesisRequest,
    TextTimeoutError,
    VoiceClonePrompt,
)
from stages.prompts import build_live_prompt, build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.reference import ReferenceGenerator
from stages.talker.engine import TalkerEngine, TalkerEngineConfig

GREEDY = SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True)
TEXT = "Hello there, assistant! How is it going?"
UNICODE_TEXT = "Café, naïve straße; 한국어 and 中文."


@pytest.fixture(scope="module")
def cv(tiny_custom_voice) -> Qwen3TTS:
    return Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)


@pytest.fixture(scope="module")
def base(tiny_base) -> Qwen3TTS:
    return Qwen3TTS.load(tiny_base, dtype="float32", decoder=False, voice=False)


@contextlib.contextmanager
def _engine(model, **overrides) -> Iterator[TalkerEngine]:
    """A started engine, shut down when the block ends."""
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, **overrides))
    engine.start(log=lambda _m: None)
    try:
        yield engine
    finally:
        engine.shutdown()


def _voice(model, ref_frames: int = 0) -> VoiceClonePrompt:
    """x-vector only (0 frames) or ICL: a 17-token transcript against `ref_frames` reference frames (the prefill
    takes ref_frames + 1 text-track positions: with 30 frames it waits for 14 target ids; with 8, none)."""
    rng = np.random.default_rng(3)
    x_vector = rng.standard_normal(model.config.talker.hidden_size).astype(np.float32)
    if not ref_frames:
        return VoiceClonePrompt(x_vector=x_vector)
    return VoiceClonePrompt(x_vector=x_vector, ref_codes=rng.integers(0, 2048, size=(ref_frames, 16)),
                            ref_text_ids=model.tokenizer.ref_text_ids("A short reference."))


def _prompts(model, mode: str):
    """(live prompt, the same request's whole-text prompt builder) for one mode."""
    kw = {
        "cv": dict(speaker="vivian", language="english", instruct="Speak slowly."),
        "cv_auto": dict(speaker="ryan", language="auto"),
        "base_icl": dict(language="english", voice=_voice(model, ref_frames=30)),
        "base_icl_short_ref": dict(language="english", voice=_voice(model, ref_frames=8)),
        "base_xvector": dict(language="auto", voice=_voice(model)),
    }[mode]
    live = build_live_prompt(model.config, model.tokenizer, **kw)

    def whole(text):
        return build_prompt(model.config, model.tokenizer, text, non_streaming_text=False, **kw)

    return live, whole


async def _until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.002)


def _waiting(engine: TalkerEngine, request_id: str) -> bool:
    """The request waits for text: held (no prefill yet) or parked (off the rows)."""
    sched = engine.scheduler
    parked = sched.parked.get(request_id)
    return request_id in sched.held or (parked is not None and not parked.restart)


async def _barrier(engine) -> None:
    """Every command sent so far (text included) has been handled by the engine thread."""
    await asyncio.wrap_future(engine.run_on_device(lambda: None))


async def _codes(stream) -> np.ndarray:
    blocks = [c.codes[c.context:] async for c in stream]
    return np.concatenate(blocks) if blocks else np.zeros((0, 16), dtype=np.int64)


async def _feed(engine, request_id: str, pieces: list[str], wait: bool = True) -> None:
    """Append pieces one by one; before each, wait until the request has caught up with its text."""
    sched = engine.scheduler
    for piece in pieces:
        if wait:
            await _barrier(engine)  # the last piece was handled: the request resumed if it could
            await _until(lambda: _waiting(engine, request_id) or sched.get(request_id) is None)
            if sched.get(request_id) is None:
                return  # it ended (max frames) before its text did
        engine.append_text(request_id, piece)
    engine.end_text(request_id)


def _pieces(model, text: str, how: str) -> list[str]:
    if how == "chars":
        return list(text)
    tok = model.tokenizer
    pieces = [tok._tok.decode([i]) for i in tok.encode(text)]
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("mode,how,text", [
    ("cv", "tokens", TEXT),
    ("cv_auto", "chars", UNICODE_TEXT),
    ("base_icl", "chars", TEXT),
    ("base_icl", "chars", "Hi."),  # ends before the prefill has its text: eos and pads inside the prefill
    ("base_icl_short_ref", "tokens", TEXT),
    ("base_xvector", "tokens", TEXT),
])
def test_piecewise_text_gives_the_codes_of_the_whole_text(cv, base, mode, how, text):
    model = base if mode.startswith("base") else cv
    live, whole = _prompts(model, mode)
    frames = 40
    reference = ReferenceGenerator(model).generate_codes(whole(text), GREEDY, frames)
    with _engine(model, max_num_seqs=2) as engine:
        async def main():
            stream = engine.open_request(SynthesisRequest("live", live, GREEDY, frames))
            feeder = asyncio.create_task(_feed(engine, "live", _pieces(model, text, how)))
            codes = await _codes(stream)
            await feeder
            return codes, stream.finish_reason
        codes, reason = asyncio.run(main())
        stats, parks = engine.stats(), engine.counters.parks
    np.testing.assert_array_equal(codes, reference)
    assert reason is FinishReason.LENGTH
    words = len(text.split())
    if mode != "base_icl":  # (ICL with a long reference: prefilled only once its first 14 ids are there)
        assert parks >= words, "the request should have waited for every word"
    assert stats.steps == frames  # waiting costs no step: one step per frame, none wasted
    assert stats.running == stats.parked == stats.held == 0 and stats.kv_reserved_tokens == 0


def test_live_text_equals_the_whole_text_through_the_engine_too(cv):
    """Same as above against the engine's own whole-text run, with a long first piece and a fast feeder."""
    live, whole = _prompts(cv, "cv")
    with _engine(cv, max_num_seqs=2) as engine:
        async def main():
            a = await _codes(engine.add_request(SynthesisRequest("whole", whole(TEXT), GREEDY, 30)))
            stream = engine.open_request(SynthesisRequest("live", live, GREEDY, 30), text=TEXT[:17])
            feeder = asyncio.create_task(_feed(engine, "live", [TEXT[17:25], TEXT[25:]], wait=False))
            b = await _codes(stream)
            await feeder
            return a, b
        a, b = asyncio.run(main())
    np.testing.assert_array_equal(a, b)


def test_a_waiting_request_costs_the_others_nothing(cv):
    """A live request parked for a while: the other row keeps stepping alone (the step runs 1 row), its codes
    are unchanged, and the live request resumes and still gives the whole-text codes."""
    live, whole = _prompts(cv, "cv")
    other = build_prompt(cv.config, cv.tokenizer, "Another request that runs meanwhile.", speaker="ryan",
                         language="english")
    # long enough to still run once the live request has its text again, however late this loop sees the 10 steps
    ref_other = ReferenceGenerator(cv).generate_codes(other, GREEDY, 150)
    ref_live = ReferenceGenerator(cv).generate_codes(whole(TEXT), GREEDY, 25)
    launches = []  # (rows stepped, live request parked) per launched step
    with _engine(cv, max_num_seqs=2) as engine:
        runner_launch = engine.runner.launch_step

        def launch_step(b, attn_len):
            launches.append((engine.scheduler.num_running, "live" in engine.scheduler.parked))
            return runner_launch(b, attn_len)

        engine.runner.launch_step = launch_step

        async def main():
            stream = engine.open_request(SynthesisRequest("live", live, GREEDY, 25), text=TEXT[:13])
            await _until(lambda: "live" in engine.scheduler.parked)  # caught up with "Hello there,"
            o = asyncio.create_task(_codes(engine.add_request(SynthesisRequest("other", other, GREEDY, 150))))
            steps_at_park = engine.stats().steps
            await _until(lambda: engine.stats().steps >= steps_at_park + 10)  # 10 steps while it waits
            assert "live" in engine.scheduler.parked
            engine.append_text("live", TEXT[13:])
            engine.end_text("live")
            return await _codes(stream), await o
        live_codes, other_codes = asyncio.run(main())
    np.testing.assert_array_equal(other_codes, ref_other)
    np.testing.assert_array_equal(live_codes, ref_live)
    alone = [n for n, parked in launches if parked]
    assert len(alone) >= 10 and set(alone) == {1}  # while it waited, steps ran the other row only
    assert any(n == 2 for n, parked in launches if not parked)  # before and after, both rows together


def test_abort_while_waiting_frees_the_slot_and_kv(cv):
    live, _ = _prompts(cv, "cv")
    other = build_prompt(cv.config, cv.tokenizer, "Hello.", speaker="ryan", language="english")
    with _engine(cv, max_num_seqs=1) as engine:
        async def main():
            held = engine.open_request(SynthesisRequest("held", live, GREEDY, 30))  # no text: no slot, no KV
            parked = engine.open_request(SynthesisRequest("parked", live, GREEDY, 30), text="Hello there, ")
            await _until(lambda: "parked" in engine.scheduler.parked and "held" in engine.scheduler.held)
            stats = engine.stats()
            assert stats.parked == 1 and stats.held == 1 and stats.running == 0 and stats.kv_reserved_tokens > 0
            engine.abort("held")
            engine.abort("parked")
            results = [(await _codes(s), s.finish_reason) for s in (held, parked)]
            # the only slot is free again: a new request runs in it
            after = await _codes(engine.add_request(SynthesisRequest("after", other, GREEDY, 5)))
            with pytest.raises(InvalidRequestError, match="not open"):
                engine.append_text("parked", "more")
            return results, after
        (held_result, parked_result), after = asyncio.run(main())
        stats = engine.stats()
    assert held_result[1] is FinishReason.ABORTED and len(held_result[0]) == 0
    assert parked_result[1] is FinishReason.ABORTED and len(parked_result[0]) > 0  # its frames so far came out
    assert len(after) == 5
    assert stats.parked == stats.held == stats.running == 0 and stats.kv_reserved_tokens == 0


def test_idle_timeout_ends_a_request_whose_text_does_not_arrive(cv):
    live, whole = _prompts(cv, "cv")
    ref = ReferenceGenerator(cv).generate_codes(whole(TEXT), GREEDY, 30)
    with _engine(cv, max_num_seqs=2, text_idle_timeout_s=0.5) as engine:
        async def main():
            parked = engine.open_request(SynthesisRequest("parked", live, GREEDY, 30), text=TEXT[:13])
            held = engine.open_request(SynthesisRequest("held", live, GREEDY, 30))
            out = []
            for stream in (parked, held):
                blocks = []
                with pytest.raises(TextTimeoutError, match="no text"):
                    async for chunk in stream:
                        blocks.append(chunk.codes[chunk.context:])
                out.append((np.concatenate(blocks) if blocks else np.zeros((0, 16)), stream.finish_reason))
            return out
        (p_codes, p_reason), (h_codes, h_reason) = asyncio.run(main())
        stats = engine.stats()
    assert p_reason is h_reason is FinishReason.ERROR
    assert len(h_codes) == 0 and 0 < len(p_codes) < 30
    np.testing.assert_array_equal(p_codes, ref[:len(p_codes)])  # every frame it made was delivered first
    assert stats.parked == stats.held == 0 and stats.kv_reserved_tokens == 0


def test_a_request_may_bring_a_shorter_idle_timeout(cv):
    """`open_request(idle_timeout_s=...)` ends that request alone; the engine's own (long) timeout still holds for
    the other, which finishes normally. A timeout that is not > 0 is refused."""
    live, _ = _prompts(cv, "cv")
    with _engine(cv, max_num_seqs=2, text_idle_timeout_s=600.0) as engine:
        async def main():
            with pytest.raises(InvalidRequestError, match="idle timeout"):
                engine.open_request(SynthesisRequest("bad", live, GREEDY, 8), idle_timeout_s=0.0)
            short = engine.open_request(SynthesisRequest("short", live, GREEDY, 8), idle_timeout_s=0.3)
            # two words: the last is held back (it may grow), so `other` cannot reach its 8 frames before its
            # text ends: it is still open, whatever the threads' timing, when `short` times out
            other = engine.open_request(SynthesisRequest("other", live, GREEDY, 8), text="Hello there")
            with pytest.raises(TextTimeoutError, match="no text for 0.3 s"):
                async for _ in short:
                    pass
            engine.end_text("other")  # only after `short` timed out: `other` waited for text meanwhile
            return await _codes(other), other.finish_reason
        codes, reason = asyncio.run(main())
    assert reason in (FinishReason.EOS, FinishReason.LENGTH) and len(codes) > 0


def test_flush_then_end_speaks_the_text_so_far_as_a_whole(cv):
    """flush releases the held-back last word and closes the utterance: with nothing after it, the codes are
    those of the text so far sent whole (its eos row, then pad rows)."""
    live, whole = _prompts(cv, "cv")
    text = "Hello there, assis"
    ref = ReferenceGenerator(cv).generate_codes(whole(text), GREEDY, 30)
    with _engine(cv, max_num_seqs=1) as engine:
        async def main():
            stream = engine.open_request(SynthesisRequest("f", live, GREEDY, 30), text=text)
            await _until(lambda: _waiting(engine, "f"))  # waits: "assis" is held back (it may grow)
            engine.flush_text("f")
            task = asyncio.create_task(_codes(stream))
            await _until(lambda: engine.stats().frames >= 20)  # it speaks on: the text ended, as far as it knows
            engine.end_text("f")
            return await task, stream.finish_reason
        codes, reason = asyncio.run(main())
    np.testing.assert_array_equal(codes, ref)
    assert reason is FinishReason.LENGTH


def test_an_utterance_longer_than_the_text_rows_fails_cleanly(cv):
    live, _ = _prompts(cv, "cv")
    with _engine(cv, max_num_seqs=1, max_text_rows=8) as engine:
        async def main():
            stream = engine.open_request(SynthesisRequest("long", live, GREEDY, 30))
            engine.append_text("long", "one two three four five six seven eight nine ten")
            with pytest.raises(InvalidRequestError, match="too long"):
                await _codes(stream)
        asyncio.run(main())
        stats = engine.stats()
    assert stats.held == stats.parked == stats.running == 0 and stats.kv_reserved_tokens == 0


def test_live_requests_are_validated_at_open(cv):
    live, whole = _prompts(cv, "cv")
    with _engine(cv, max_num_seqs=1) as engine:
        async def main():
            with pytest.raises(InvalidRequestError, match="streaming-text"):
                engine.open_request(SynthesisRequest("a", build_prompt(cv.config, cv.tokenizer, "Hi", speaker="ryan",
                                                                        language="english")))
            with pytest.raises(InvalidRequestError, match="append_text"):
                engine.open_request(SynthesisRequest("b", whole("Hi"), GREEDY, 5))
            with pytest.raises(InvalidRequestError, match="too long"):
                engine.open_request(SynthesisRequest("c", live, GREEDY, 10_000))
            stream = engine.open_request(SynthesisRequest("d", live, GREEDY, 5))
            with pytest.raises(InvalidRequestError, match="already open"):
                engine.open_request(SynthesisRequest("d", live, GREEDY, 5))
            engine.end_text("d")  # no text at all
            with pytest.raises(InvalidRequestError, match="empty"):
                await _codes(stream)
        asyncio.run(main())


@pytest.fixture(scope="module")
def eos_cv(tiny_custom_voice) -> Qwen3TTS:
    """The tiny CustomVoice model with codec EOS made likely: EOS's head row is a scaled copy of the row of a
    code greedy decoding picks early, so greedy runs end (random weights alone almost never end)."""
    import torch

    model = Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)
    _, whole = _prompts(model, "cv")
    c0 = ReferenceGenerator(model).generate_codes(whole("Hello there."), GREEDY, 12)[:, 0]
    with torch.no_grad():
        w = model.talker.codec_head.weight
        w[model.config.talker.codec.eos] = w[int(c0[-1])] * 1.01
    return model


@pytest.mark.parametrize("when", ["while_speaking", "after_its_end"])
def test_flush_speaks_each_utterance_whole_on_one_stream(eos_cv, when):
    """text1, flush, text2, end: the stream carries text1 spoken whole (to its codec EOS), then text2 spoken
    whole, in the request's slot and KV; text2 sent while text1 is still spoken or after it has ended."""
    params = SamplingParams(do_sample=False, subtalker_do_sample=False)
    live, whole = _prompts(eos_cv, "cv")
    text1, text2 = "Hello there.", "And now, assistant, the second one!"
    max_frames = 60
    ref1 = ReferenceGenerator(eos_cv).generate_codes(whole(text1), params, max_frames)
    assert 2 <= len(ref1) < 30, "the patched model should end the first utterance early"
    ref2 = ReferenceGenerator(eos_cv).generate_codes(whole(text2), params, max_frames - len(ref1))
    with _engine(eos_cv, max_num_seqs=1) as engine:
        async def main():
            stream = engine.open_request(SynthesisRequest("s", live, params, max_frames), text=text1)
            engine.flush_text("s")
            task = asyncio.create_task(_codes(stream))
            if when == "after_its_end":  # the first utterance ends; the request waits, keeping slot and KV
                await _until(lambda: (p := engine.scheduler.parked.get("s")) is not None and p.restart)
                stats = engine.stats()
                assert stats.parked == 1 and stats.running == 0 and stats.kv_reserved_tokens > 0
            engine.append_text("s", text2)
            engine.end_text("s")
            return await task, stream.finish_reason, engine.stats()
        codes, reason, stats = asyncio.run(main())
    np.testing.assert_array_equal(codes, np.concatenate([ref1, ref2]))
    assert reason is (FinishReason.EOS if len(ref1) + len(ref2) < max_frames else FinishReason.LENGTH)
    assert stats.prefills == 2 and stats.kv_reserved_tokens == 0
    assert stats.admitted == 1 and stats.first_chunks == 1  # two prefills, one request: its first audio once
