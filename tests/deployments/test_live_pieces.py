"""A WebSocket context's text outgrowing one Talker live request (deployments/ingress/live_pieces.py), on the fake
talker engine (tests/fake_engine.py: a frame per character of live text, EOS once its text ended and is spoken).
Every piece is a real engine live request built by the ingress's request builder; its frames "decoded" here to PCM
that says which request (seed) made it."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from deployments.config import LongFormSettings, TTSServingArgs
from deployments.ingress.live_pieces import MAX_RUNNING, FinishedPiece, LivePieces, StartedPiece
from deployments.ingress.long_text import piece_seed
from deployments.ingress.request_builder import VoiceChoice, build_request
from deployments.ingress.schemas import SpeechRequest
from deployments.messages import Admitted, DecodedChunk
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME, FinishReason
from tests.conftest import tiny_model_info
from tests.fake_engine import FakeTalkerEngine, FakeTalkerEngineConfig

SETTINGS = LongFormSettings(sentence_pause_s=0.25, paragraph_pause_s=0.5)
SEED = 11
SENTENCES = ("The first sentence is here. It has another one, which is longer than the first, and it goes on. " * 3 +
             "\n\n" + "The second paragraph starts here. It goes on for a while, then it ends. " * 3)
TEXT = (SENTENCES * 2).strip()


@pytest.fixture(scope="module")
def info(tiny_custom_voice):
    return dataclasses.replace(tiny_model_info("cv", tiny_custom_voice), max_seq_len=200)  # ~90 characters a piece


@pytest.fixture
def engine():
    e = FakeTalkerEngine(None, FakeTalkerEngineConfig(max_num_seqs=8, step_interval_s=0.001))
    e.start(log=lambda *a: None)
    yield e
    e.shutdown()


def pcm_of(seed: int | None, frames: int) -> np.ndarray:
    return np.full(frames * SAMPLES_PER_FRAME, (seed or 0) % 30_000 + 1, np.int16)


class EngineIO:
    """`PieceIO` over the fake engine: each piece a live request built as the ingress builds it; what happened."""

    def __init__(self, engine: FakeTalkerEngine, info, frame_cap: int | None = None, suppress_eos: bool = False):
        self.engine, self.info, self.frame_cap = engine, info, frame_cap
        self.body = SpeechRequest(model="cv", input="", voice="ryan", seed=SEED, suppress_eos=suppress_eos)
        self.args = TTSServingArgs.model_validate({"models": [{"name": "cv"}], "ingress": {"allow_suppress_eos": True}})
        self.log: list[tuple] = []  # ("start", k) / ("chunk", k) / ("closed", k), in order
        self.seeds: list[int | None] = []
        self.events: dict[str, list] = {}
        self.closed: list[str] = []

    def running(self) -> int:
        started = sum(1 for e in self.log if e[0] == "start")
        return started - sum(1 for e in self.log if e[0] == "closed")

    async def start(self, index: int, request_id: str) -> StartedPiece:
        body = self.body.model_copy(update={"seed": piece_seed(SEED, index)})
        request, _ = build_request(body, self.info, VoiceChoice(speaker="ryan"), None, self.args, request_id, live=True)
        fits = request.max_frames
        if self.frame_cap is not None:
            request = dataclasses.replace(request, max_frames=min(fits, self.frame_cap))
        self.log.append(("start", index))
        assert self.running() <= MAX_RUNNING, self.log
        self.seeds.append(request.seed)
        stream = self.engine.open_request(request)

        async def chunks():
            try:
                yield Admitted(request_id)
                async for c in stream:
                    self.log.append(("chunk", index))
                    yield DecodedChunk(request_id, c.seq, pcm_of(request.seed, c.num_new), c.final, c.finish_reason)
            finally:
                self.log.append(("closed", index))
                await stream.aclose()

        return StartedPiece(chunks(), fits, self.body.suppress_eos)

    async def put(self, request_id: str, events) -> None:
        self.events.setdefault(request_id, []).extend(events)
        for e in events:
            if e.kind == "append":
                self.engine.append_text(request_id, e.text)
            elif e.kind == "flush":
                self.engine.flush_text(request_id)
            else:
                self.engine.end_text(request_id)

    def close(self, request_id: str) -> None:
        self.closed.append(request_id)


async def speak(io: EngineIO, parts: list[str], frame_cap: int | None = None, cuts: list | None = None):
    """Feed `parts` (then `end`) and read every chunk, as the session does -> (chunks, finished pieces, pieces)."""
    finished: list[FinishedPiece] = []
    pieces = LivePieces(io, "ctx", io.info.tokenizer, io.info.max_text_rows, SETTINGS, frame_cap,
                        on_cut=lambda k, frames: (cuts if cuts is not None else []).append((k, frames)),
                        on_piece=finished.append)
    await pieces.open()
    chunks = pieces.chunks()
    assert isinstance(await anext(chunks), Admitted)
    reader = asyncio.create_task(_all(chunks))
    for part in parts:
        await pieces.append(part)
    await pieces.end()
    seen = await reader
    await pieces.aclose()
    return seen, finished, pieces


async def _all(chunks):
    return [c async for c in chunks]


def test_a_long_context_is_every_piece_in_order_with_pauses_and_one_end(engine, info):
    io = EngineIO(engine, info)
    seen, finished, pieces = asyncio.run(speak(io, [TEXT]))
    n = pieces.pieces
    assert n >= 6 and [p.index for p in finished] == list(range(n))
    assert "".join(p.text for p in finished) == TEXT  # every character, once, in order
    # one frame per character of text (the fake engine): the whole text was spoken, each piece ended by EOS
    assert pieces.frames == len(TEXT) == sum(p.frames for p in finished)
    assert pieces.finish_reason is FinishReason.EOS and all(p.finish_reason is FinishReason.EOS for p in finished)
    assert not any(c.final or c.finish_reason for c in seen)  # no piece's own end leaks out: the session ends once
    # pieces end between words, mostly where a reader pauses (a sentence or clause end past half a piece; a word
    # only when the next would not fit), with the pause the boundary implies; none after the last
    assert all(p.text[-1].isspace() for p in finished[:-1])
    assert sum(p.text.rstrip()[-1] in ".," for p in finished[:-1]) >= 0.75 * (n - 1)
    for p in finished[:-1]:
        assert p.pause_after_s == (SETTINGS.paragraph_pause_s if p.text.endswith("\n\n") else
                                   SETTINGS.sentence_pause_s if p.text.rstrip().endswith(".") else 0.0)
    assert finished[-1].pause_after_s == 0 and {p.pause_after_s for p in finished[:-1]} >= {0.25, 0.5}
    # the offsets place each piece's audio in the context's audio, pauses between
    audio = np.concatenate([c.pcm for c in seen])
    assert audio.size == pieces.samples
    for p in finished:
        assert np.array_equal(audio[p.start_sample:p.start_sample + p.samples], p.audio)
        assert np.all(p.audio == pcm_of(piece_seed(SEED, p.index), 1)[0])
        pause = audio[p.start_sample + p.samples:p.start_sample + p.samples + round(p.pause_after_s * SAMPLE_RATE)]
        assert not pause.any()
    # pipelined: piece k+1 started before piece k's audio was all read; never more than two at once (EngineIO)
    for k in range(n - 1):
        last_chunk_of_k = max(i for i, e in enumerate(io.log) if e == ("chunk", k))
        assert io.log.index(("start", k + 1)) < last_chunk_of_k, io.log
    assert io.seeds == [piece_seed(SEED, k) for k in range(n)] and io.seeds[0] == SEED
    assert sorted(io.closed) == sorted({*io.events}) and not engine.live_requests()


def test_boundaries_and_audio_do_not_depend_on_how_the_text_arrives(engine, info):
    _, whole, _ = asyncio.run(speak(EngineIO(engine, info), [TEXT]))
    words = TEXT.split(" ")
    _, by_word, _ = asyncio.run(speak(EngineIO(engine, info), [w + " " for w in words[:-1]] + [words[-1]]))
    _, by_char, _ = asyncio.run(speak(EngineIO(engine, info), list(TEXT)))
    for other in (by_word, by_char):
        assert [p.text for p in other] == [p.text for p in whole]
        assert all(np.array_equal(a.audio, b.audio) and a.start_sample == b.start_sample
                   for a, b in zip(other, whole, strict=True))


def test_a_short_context_is_one_request_with_the_contexts_own_seed(engine, info):
    io = EngineIO(engine, info)
    seen, finished, pieces = asyncio.run(speak(io, ["Hello there, ", "one request."]))
    assert pieces.pieces == 1 and io.seeds == [SEED] and finished[0].text == "Hello there, one request."
    assert [e.kind for e in io.events["ctx"]][-1] == "end" and not any(c.pause for c in seen)


def test_the_clients_max_new_tokens_bounds_the_whole_context(engine, info):
    io = EngineIO(engine, info, frame_cap=150)
    seen, finished, pieces = asyncio.run(speak(io, [TEXT], frame_cap=150))
    assert pieces.frames == 150 and sum(c.codec_frames for c in seen) == 150
    assert pieces.finish_reason is FinishReason.LENGTH and len(finished) >= 2
    assert not engine.live_requests()


def test_a_piece_cut_at_its_frame_cap_is_reported_and_the_context_says_length(tiny_custom_voice, info):
    slow = FakeTalkerEngine(None, FakeTalkerEngineConfig(max_num_seqs=8, step_interval_s=0.001,
                                                          live_frames_per_char=4))  # slower than the estimate
    slow.start(log=lambda *a: None)
    try:
        cuts: list = []
        _, finished, pieces = asyncio.run(speak(EngineIO(slow, info), [TEXT], cuts=cuts))
    finally:
        slow.shutdown()
    assert cuts and all(finished[k].finish_reason is FinishReason.LENGTH for k, _ in cuts)
    assert pieces.finish_reason is FinishReason.LENGTH


def test_closing_mid_way_aborts_every_running_piece(engine, info):
    async def main():
        io = EngineIO(engine, info)
        pieces = LivePieces(io, "ctx", info.tokenizer, info.max_text_rows, SETTINGS)
        await pieces.open()
        chunks = pieces.chunks()
        await anext(chunks)
        await pieces.append(TEXT)  # no `end`: the last piece waits for more text
        assert ("start", 1) in io.log  # started when piece 0 rolled over
        await anext(chunks)  # piece 0's audio is being sent
        assert io.running() == MAX_RUNNING  # both pieces open (the engine may have finished piece 0 already)
        await chunks.aclose()
        await pieces.aclose()
        await pieces.append("More text after the end. " * 20)  # starts nothing
        return io

    io = asyncio.run(main())
    started = [e[1] for e in io.log if e[0] == "start"]
    assert started == [0, 1] and sorted(e[1] for e in io.log if e[0] == "closed") == started
    assert sorted(io.closed) == ["ctx", "ctx.1"]
    deadline = time.monotonic() + 30  # aborts take effect at the engine's next step
    while (engine.live_requests() or engine.stats().running) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.live_requests() and engine.stats().running == 0
