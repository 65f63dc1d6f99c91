"""Word timestamps of a response (deployments/ingress/timestamps.py) through the writers (speech.py): a long input's
pieces on the fake talker engine, aligned by a fake aligner that spreads a span's words evenly over its audio."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from pydantic import ValidationError

from deployments.config import BackpressureSettings
from deployments.errors import APIError
from deployments.ingress.http_guard import OpenWork
from deployments.ingress.long_form import long_form_chunks
from deployments.ingress.outcomes import Outcomes
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.speech import SpeechJob, _stream, whole_response
from deployments.ingress.timestamps import ResponseTimestamps, char_times, check_language, no_aligner
from deployments.messages import AlignRequest, DecodedChunk
from stages.aligner import Word
from stages.aligner.words import split_words
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.deployments import test_long_form
from tests.deployments.test_long_form import TEXT, Run

pieces, engine = test_long_form.pieces, test_long_form.engine  # its fixtures: a long input's pieces, the fake engine


class FakeAligner:
    """A span's words spread evenly over its audio; `fail` names request ids it refuses; `hold` keeps a span's
    alignment waiting until released."""

    def __init__(self, fail: frozenset[str] = frozenset()):
        self.fail, self.calls, self.hold, self.answered = fail, [], {}, []

    async def __call__(self, request: AlignRequest) -> list[Word]:
        self.calls.append(request)
        if request.request_id in self.hold:
            await self.hold[request.request_id].wait()
        if request.request_id in self.fail:
            raise APIError(400, "the aligner refused it", param="timestamps", code="cannot_align")
        words = split_words(request.text)
        seconds = request.pcm.size / SAMPLE_RATE
        step = seconds / max(len(words), 1)
        self.answered.append(request.request_id)
        return [Word(w, round(i * step, 3), round((i + 1) * step, 3)) for i, w in enumerate(words)]


def _job(pieces, run: Run, aligner: FakeAligner, mode: str = "word", speed: float = 1.0, stream: bool = True):
    body = SpeechRequest(model="cv", input=TEXT, response_format="pcm", timestamps=mode, speed=speed,
                         stream=stream)
    chunks = long_form_chunks(pieces, run.start_piece, 60.0, lambda piece, frames: None)
    job = SpeechJob(body, "cv", chunks, None, asyncio.get_running_loop().time() + 60, 0.0, usage_in=1,
                    pieces=len(pieces))
    job.timestamps = ResponseTimestamps(aligner, {p.request.request_id: p.text for p in pieces}, mode, None, speed)
    return job


async def _events(pieces, run: Run, aligner: FakeAligner, **kw) -> list[dict]:
    job = _job(pieces, run, aligner, **kw)
    job.first = await anext(job.chunks)
    out = b""
    async for data in _stream(job, Outcomes(BackpressureSettings(), ["cv"]), OpenWork(4, 1.0)):
        out += data
    return [json.loads(e[6:]) for e in out.decode().split("\n\n") if e]


def _piece_seconds(pieces) -> list[tuple[float, float]]:
    """Each piece's (start, end) in the response: its frames, then its pause."""
    spans, at = [], 0.0
    for p in pieces:
        audio = frames_of(p) * SAMPLES_PER_FRAME / SAMPLE_RATE
        spans.append((at, at + audio))
        at += audio + p.pause_s
    return spans


def frames_of(piece) -> int:
    return piece.request.max_frames


def test_sse_sends_each_pieces_words_after_its_audio_and_before_done(pieces, engine):
    aligner = FakeAligner()
    events = asyncio.run(_events(pieces, Run(engine), aligner))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and kinds.count("speech.audio.timestamps") == len(pieces)
    assert [c.text for c in aligner.calls] == [p.text for p in pieces]
    assert [c.request_id for c in aligner.calls] == [p.request.request_id for p in pieces]
    # each piece's words come after all of its audio (the audio sent so far covers their end), in piece order
    sent_s, spans, k = 0.0, _piece_seconds(pieces), 0
    for e in events:
        if e["type"] == "speech.audio.delta":
            sent_s += len(base64.b64decode(e["audio"])) / 2 / SAMPLE_RATE
        elif e["type"] == "speech.audio.timestamps":
            start, end = spans[k]
            assert [w["word"] for w in e["words"]] == split_words(pieces[k].text)
            assert e["words"][0]["start"] == pytest.approx(start, abs=1e-3)  # times continue across pieces
            assert e["words"][-1]["end"] == pytest.approx(end, abs=1e-3) and end <= sent_s + 1e-6
            assert all(a["end"] <= b["start"] + 1e-3 for a, b in zip(e["words"], e["words"][1:], strict=False))
            k += 1
    assert k == len(pieces)


def test_a_later_span_aligned_first_waits_for_the_earlier_one(pieces, engine):
    async def main():
        aligner = FakeAligner()
        first = pieces[0].request.request_id
        aligner.hold[first] = asyncio.Event()

        async def release_once_the_second_is_answered():
            while pieces[1].request.request_id not in aligner.answered:
                await asyncio.sleep(0.005)
            aligner.hold[first].set()

        releaser = asyncio.get_running_loop().create_task(release_once_the_second_is_answered())
        events = await _events(pieces[:2], Run(engine), aligner)
        await releaser
        return events

    events = [e for e in asyncio.run(main()) if e["type"] == "speech.audio.timestamps"]
    assert [e["words"][0]["word"] for e in events] == [split_words(p.text)[0] for p in pieces[:2]]


def test_speed_scales_the_times_and_chars_cover_every_character(pieces, engine):
    events = asyncio.run(_events(pieces[:1], Run(engine), FakeAligner(), mode="char", speed=2.0))
    ts = [e for e in events if e["type"] == "speech.audio.timestamps"][0]
    audio = frames_of(pieces[0]) * SAMPLES_PER_FRAME / SAMPLE_RATE
    assert ts["words"][-1]["end"] == pytest.approx(audio / 2, abs=1e-3)
    assert "".join(c["char"] for c in ts["chars"]) == pieces[0].text


def test_a_span_the_aligner_refuses_gets_its_error_and_the_stream_ends_normally(pieces, engine):
    events = asyncio.run(_events(pieces[:3], Run(engine), FakeAligner(fail=frozenset({pieces[1].request.request_id}))))
    ts = [e for e in events if e["type"] == "speech.audio.timestamps"]
    assert [bool(e["words"]) for e in ts] == [True, False, True]
    assert ts[1]["error"]["code"] == "cannot_align" and events[-1]["type"] == "speech.audio.done"


def test_a_whole_body_is_json_with_the_audio_and_every_word(pieces, engine):
    async def main():
        job = _job(pieces[:2], Run(engine), FakeAligner(), mode="char", stream=False)
        job.first = await anext(job.chunks)
        return await whole_response(job, Outcomes(BackpressureSettings(), ["cv"]), {})

    response = asyncio.run(main())
    body = json.loads(response.body)
    audio = np.frombuffer(base64.b64decode(body["audio"]), np.int16)
    total = _piece_seconds(pieces[:2])[-1][1] + pieces[1].pause_s  # (piece 1 is not the input's last: a pause follows)
    assert body["response_format"] == "pcm" and audio.size / SAMPLE_RATE == pytest.approx(total)
    assert body["audio_seconds"] == pytest.approx(total, abs=1e-3)
    assert [w["word"] for w in body["words"]] == split_words(pieces[0].text) + split_words(pieces[1].text)
    assert len(body["chars"]) == len(pieces[0].text) + len(pieces[1].text)
    assert body["finish_reason"] == "eos" and body["usage"]["output_tokens"] == sum(map(frames_of, pieces[:2]))


def test_a_client_that_leaves_cancels_the_alignments_under_way():
    async def main():
        aligner = FakeAligner()
        aligner.hold["a"] = asyncio.Event()  # never released
        ts = ResponseTimestamps(aligner, {"a": "hello there"}, "word", None)
        ts.observe(DecodedChunk("a", 0, np.ones(4800, np.int16), True, None))
        ts.end()
        while not aligner.calls:
            await asyncio.sleep(0)
        pending = ts._pending[0].task
        await ts.aclose()
        return pending

    assert asyncio.run(main()).cancelled()


def test_char_times_spread_a_words_time_over_its_letters_and_pin_the_rest():
    words = [{"word": "It's", "start": 0.0, "end": 0.4}, {"word": "on", "start": 0.5, "end": 0.7}]
    chars = char_times("It's on.", words)
    assert "".join(c["char"] for c in chars) == "It's on."
    assert [(c["start"], c["end"]) for c in chars] == [
        (0.0, 0.1), (0.1, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.4), (0.5, 0.6), (0.6, 0.7), (0.7, 0.7)]
    assert char_times("", []) == [] and char_times("...", []) == [{"char": ".", "start": 0.0, "end": 0.0}] * 3


def test_timestamps_need_an_aligner_a_language_it_times_and_no_raw_stream():
    error = no_aligner()
    assert error.status == 400 and error.param == "timestamps" and error.code == "timestamps_unavailable"
    for language in (None, "auto", "English", "chinese"):
        check_language(language)
    for language in ("Japanese", "korean", "Klingon"):
        with pytest.raises(APIError) as exc:
            check_language(language)
        assert exc.value.status == 400 and exc.value.param == "timestamps" and exc.value.code == "unsupported_language"
    with pytest.raises(ValidationError, match="raw audio stream"):
        SpeechRequest(input="x", timestamps="word", stream_format="audio")
    assert SpeechRequest(input="x", timestamps="word").sse and not SpeechRequest(input="x").sse
    assert not SpeechRequest(input="x", timestamps="word", stream=False).sse


def test_a_word_the_aligner_places_past_its_audio_ends_with_that_audio():
    async def main():
        async def far(request: AlignRequest) -> list[Word]:
            return [Word("hello", 0.1, 0.2), Word("there", 30.0, 399.92)]

        ts = ResponseTimestamps(far, {"a": "hello", "b": "hello there"}, "word", None)
        ts.observe(DecodedChunk("a", 0, np.ones(SAMPLE_RATE, np.int16), False, None))  # 1 s
        ts.observe(DecodedChunk("b", 0, np.ones(SAMPLE_RATE // 2, np.int16), True, None))  # 0.5 s
        ts.end()
        return await ts.rest()

    first, second = asyncio.run(main())
    assert second["words"] == [{"word": "hello", "start": 1.1, "end": 1.2}, {"word": "there", "start": 1.5, "end": 1.5}]
    assert first["words"][1] == {"word": "there", "start": 1.0, "end": 1.0}
