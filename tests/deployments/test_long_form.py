"""A long input's pieces run into one response (deployments/ingress/long_form.py, speech.py), on the fake talker
engine (tests/fake_engine.py): every piece is a real engine request, its frames "decoded" to silence here."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json

import numpy as np
import pytest
import soundfile as sf

from deployments.config import BackpressureSettings, TTSServingArgs
from deployments.errors import StreamAborted
from deployments.ingress.http_guard import OpenWork
from deployments.ingress.long_form import long_form_chunks
from deployments.ingress.long_text import PiecePlanner, PlannedPiece
from deployments.ingress.outcomes import Outcomes
from deployments.ingress.request_builder import VoiceChoice
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.speech import SpeechJob, _stream, whole_response
from deployments.messages import DecodedChunk
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME, FinishReason
from tests.conftest import tiny_model_info
from tests.fake_engine import FakeTalkerEngine, FakeTalkerEngineConfig

TEXT = ("The first paragraph has a sentence. It has another one, which is longer than the first. " * 3 + "\n\n" +
        "The second paragraph starts here. It goes on for a while, and then it ends. " * 3)
FRAMES = 5  # each piece's frames (the fake engine runs every request to its cap)
SENTENCE_PAUSE, PARAGRAPH_PAUSE = 0.25, 0.5


@pytest.fixture(scope="module")
def pieces(tiny_custom_voice) -> list[PlannedPiece]:
    info = dataclasses.replace(tiny_model_info("cv", tiny_custom_voice), max_seq_len=200)  # pieces of ~45 characters
    args = TTSServingArgs.model_validate({"models": [{"name": "cv"}], "ingress": {"long_form": {
        "sentence_pause_s": SENTENCE_PAUSE, "paragraph_pause_s": PARAGRAPH_PAUSE}}})
    body = SpeechRequest(model="cv", input=TEXT, voice="ryan", seed=11)
    planned = PiecePlanner(body, info, VoiceChoice(speaker="ryan"), None, args, "long").pieces()
    assert planned is not None and len(planned) >= 4
    assert not any(p.client_capped for p in planned)  # capped at what fits max_seq_len: stopping there is a cut
    return [dataclasses.replace(p, request=dataclasses.replace(p.request, max_frames=FRAMES)) for p in planned]


class Run:
    """The fake engine and what happened, in order: pieces started and closed, chunks handed to the writer."""

    def __init__(self, engine: FakeTalkerEngine, cut: frozenset[int] = frozenset()):
        self.engine, self.cut, self.events = engine, cut, []
        self.requests: list[str] = []

    async def start_piece(self, piece: PlannedPiece):
        """A piece's pipeline as the ingress's (nothing runs before its first chunk is awaited): the engine's
        chunks, decoded to silence; a piece in `cut` stops at its cap, the others end by EOS."""
        self.events.append(("start", piece.index))
        self.requests.append(piece.request.request_id)
        stream = self.engine.add_request(piece.request)
        try:
            async for c in stream:
                finish = c.finish_reason and (FinishReason.LENGTH if piece.index in self.cut else FinishReason.EOS)
                yield DecodedChunk(c.request_id, c.seq, np.full(c.num_new * SAMPLES_PER_FRAME, 7, np.int16), c.final,
                                   finish)
        finally:
            self.events.append(("closed", piece.index))
            await stream.aclose()

    def chunks(self, pieces, cuts: list | None = None):
        return long_form_chunks(pieces, self.start_piece, 60.0,
                                lambda piece, frames: (cuts if cuts is not None else []).append((piece.index, frames)))


@pytest.fixture
def engine():
    e = FakeTalkerEngine(None, FakeTalkerEngineConfig(max_num_seqs=4, step_interval_s=0.001))
    e.start(log=lambda *a: None)
    yield e
    e.shutdown()


def _index_of_piece(chunk: DecodedChunk) -> int:
    return int(chunk.request_id.rsplit(".", 1)[1])


def test_pieces_run_in_order_each_started_before_the_one_before_is_drained(pieces, engine):
    async def main():
        run, seen = Run(engine), []
        async for chunk in run.chunks(pieces):
            run.events.append(("yield", _index_of_piece(chunk), chunk.pause, chunk.final))
            seen.append(chunk)
        return run, seen

    run, seen = asyncio.run(main())
    n = len(pieces)
    assert run.requests == [f"long.{k}" for k in range(n)]
    for k in range(n - 1):
        started_next = run.events.index(("start", k + 1))
        last_audio_of_k = max(i for i, e in enumerate(run.events) if e[:3] == ("yield", k, False))
        assert started_next < last_audio_of_k, run.events  # piece k+1 admitted while piece k is still being sent
        if k + 2 < n:  # never more than two pieces of a request at once
            assert run.events.index(("closed", k)) < run.events.index(("start", k + 2))
    audio = [c for c in seen if not c.pause]
    assert sum(c.codec_frames for c in seen) == FRAMES * n and all(c.codec_frames == 0 for c in seen if c.pause)
    # one end: the last chunk, with the input's finish reason; no piece's own end leaks out
    assert [c.final for c in seen].count(True) == 1 and seen[-1].final and seen[-1].finish_reason is FinishReason.EOS
    assert all(c.finish_reason is None for c in seen[:-1]) and audio[-1] is seen[-1]


def test_a_pause_follows_each_piece_but_the_last_longer_after_a_paragraph(pieces, engine):
    async def main():
        return [c async for c in Run(engine).chunks(pieces)]

    seen = asyncio.run(main())
    pauses = [(_index_of_piece(c), c.pcm.size / SAMPLE_RATE) for c in seen if c.pause]
    expected = [(p.index, p.pause_s) for p in pieces if p.pause_s > 0]
    assert pauses == expected and pieces[-1].pause_s == 0
    assert {p.pause_s for p in pieces[:-1]} == {SENTENCE_PAUSE, PARAGRAPH_PAUSE}  # the text has both boundaries
    assert all(not c.pcm.any() for c in seen if c.pause) and all(c.pcm.all() for c in seen if not c.pause)


def test_a_piece_cut_at_its_frame_cap_is_reported_unless_the_client_capped_it(pieces, engine):
    async def main(client_capped):
        cuts = []
        capped = [dataclasses.replace(p, client_capped=client_capped) for p in pieces]
        seen = [c async for c in Run(engine, cut=frozenset({1})).chunks(capped, cuts)]
        return seen[-1].finish_reason, cuts

    assert asyncio.run(main(False)) == (FinishReason.LENGTH, [(1, FRAMES)])
    assert asyncio.run(main(True)) == (FinishReason.LENGTH, [])


def test_closing_the_response_aborts_the_current_piece_and_the_one_started_ahead(pieces, tiny_custom_voice):
    # pieces that go on for as long as the test runs
    engine = FakeTalkerEngine(None, FakeTalkerEngineConfig(max_num_seqs=4, step_interval_s=0.001))
    engine.start(log=lambda *a: None)
    stuck = [dataclasses.replace(p, request=dataclasses.replace(p.request, max_frames=10_000)) for p in pieces]

    async def main():
        run = Run(engine)
        chunks = run.chunks(stuck)
        await anext(chunks)  # piece 0 sends; piece 1 was started ahead
        while engine.stats().running < 2:
            await asyncio.sleep(0.005)
        await chunks.aclose()  # the client left
        for _ in range(2000):
            stats = engine.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
            await asyncio.sleep(0.005)
        return run, engine.stats()

    try:
        run, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    assert stats.running == 0 and stats.waiting == 0
    assert sorted(e for e in run.events if e[0] == "closed") == [("closed", 0), ("closed", 1)]
    assert ("start", 2) not in run.events  # no later piece was ever started


def _job(pieces, run: Run, fmt: str, stream_format: str = "audio", capped: bool = False) -> SpeechJob:
    """A long input's response as the ingress makes it (server.TTSIngress._start_speech)."""
    body = SpeechRequest(model="cv", input=TEXT, response_format=fmt, stream_format=stream_format)
    cut: list[int] = []
    pieces = [dataclasses.replace(p, client_capped=capped) for p in pieces]
    chunks = long_form_chunks(pieces, run.start_piece, 60.0, lambda piece, frames: cut.append(piece.index))
    return SpeechJob(body, "cv", chunks, None, asyncio.get_running_loop().time() + 60, 0.0, usage_in=123,
                     pieces=len(pieces), cut_pieces=cut)


async def _sent(job: SpeechJob) -> bytes:
    job.first = await anext(job.chunks)
    out = b""
    async for data in _stream(job, Outcomes(BackpressureSettings(), ["cv"]), OpenWork(4, 1.0)):
        out += data
    return out


def _expected_samples(pieces) -> int:
    return len(pieces) * FRAMES * SAMPLES_PER_FRAME + sum(round(p.pause_s * SAMPLE_RATE) for p in pieces)


def test_a_streamed_wav_has_one_header_and_every_piece_and_pause(pieces, engine):
    async def main():
        return await _sent(_job(pieces, Run(engine), "wav"))

    data = asyncio.run(main())
    assert data.count(b"RIFF") == 1 and data.count(b"WAVE") == 1 and data[:4] == b"RIFF"
    assert len(data) == 44 + 2 * _expected_samples(pieces)


def test_sse_sends_one_done_with_the_usage_of_the_whole_input(pieces, engine):
    async def main():
        return await _sent(_job(pieces, Run(engine), "pcm", "sse"))

    events = [json.loads(line[6:]) for line in asyncio.run(main()).decode().split("\n\n") if line]
    kinds = [e["type"] for e in events]
    assert kinds.count("speech.audio.done") == 1 and kinds[-1] == "speech.audio.done"
    done = events[-1]
    assert done["usage"] == {"input_tokens": 123, "output_tokens": FRAMES * len(pieces),
                             "total_tokens": 123 + FRAMES * len(pieces)} and done["finish_reason"] == "eos"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(audio) == 2 * _expected_samples(pieces)


def test_a_whole_body_holds_every_piece_in_one_file(pieces, engine):
    async def main():
        job = _job(pieces, Run(engine), "flac")
        job.first = await anext(job.chunks)
        return await whole_response(job, Outcomes(BackpressureSettings(), ["cv"]), {})

    response = asyncio.run(main())
    audio, rate = sf.read(io.BytesIO(response.body), dtype="int16")
    assert rate == SAMPLE_RATE and audio.size == _expected_samples(pieces)
    assert response.headers["x-finish-reason"] == "eos"
    assert response.headers["x-usage-output-tokens"] == str(FRAMES * len(pieces))


def test_a_raw_stream_with_a_cut_piece_ends_without_looking_whole_while_sse_says_length(pieces, engine):
    async def raw():
        run = Run(engine, cut=frozenset({2}))
        job = _job(pieces, run, "pcm")
        job.first = await anext(job.chunks)
        out = []
        with pytest.raises(StreamAborted):
            async for data in _stream(job, Outcomes(BackpressureSettings(), ["cv"]), OpenWork(4, 1.0)):
                out.append(data)
        return b"".join(out)

    assert len(asyncio.run(raw())) == 2 * _expected_samples(pieces)  # all the audio, then no proper end

    async def sse():
        return await _sent(_job(pieces, Run(engine, cut=frozenset({2})), "pcm", "sse"))

    done = json.loads(asyncio.run(sse()).decode().strip().split("\n\n")[-1][6:])
    assert done["type"] == "speech.audio.done" and done["finish_reason"] == "length"

    async def capped():  # the client's own cap: a whole stream
        return await _sent(_job(pieces, Run(engine, cut=frozenset({2})), "pcm", capped=True))

    assert len(asyncio.run(capped())) == 2 * _expected_samples(pieces)
