"""AlignerServer without Serve (`sync_init` + `start`) on the real aligner and a tiny random checkpoint: calls that
arrive together or during a forward are timed in one batched forward with the aligner's own answers; a piece the
aligner cannot time fails alone with a 400; a piece with nothing to time is answered [] without a forward."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from deployments.aligner.engine_protocol import AlignerEngineProtocol
from deployments.aligner.server import AlignerServer, plan_forwards
from deployments.config import AlignerDeploymentConfig
from deployments.errors import APIError
from deployments.messages import AlignerInfo, AlignRequest
from stages.aligner import Aligner, Word
from stages.aligner.random_checkpoint import write_random_aligner
from stages.contract import SAMPLE_RATE

TEXTS = ["One two, three.", "你好，世界", "Don't stop -- 3.5 km!", "Hello world"]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_aligner(tmp_path_factory.mktemp("aligner"), tiny=True, dtype="float32", log=lambda *_: None)


@pytest.fixture(scope="module")
def aligner(checkpoint) -> Aligner:
    return Aligner.load(checkpoint)


class Spy:
    """The real aligner, recording each forward's pieces; `hold` keeps the next forward waiting until released,
    `refuse` makes the aligner refuse any forward holding that text (as a check the server missed would)."""

    def __init__(self, engine: Aligner, refuse: str | None = None):
        self.engine, self.refuse = engine, refuse
        self.max_seconds = engine.max_seconds
        self.forwards: list[list[str]] = []
        self.late = 0  # graphs the next forwards capture (a shape the warm-up missed)
        self.capture_next = 0
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()

    def min_samples(self, sample_rate):
        return self.engine.min_samples(sample_rate)

    def prepare_piece(self, audio, text, sample_rate, language=""):
        return text, self.engine.prepare_piece(audio, text, sample_rate, language)

    def warm_up(self, max_pieces, max_audio_s):
        return self.engine.warm_up(max_pieces, max_audio_s)

    def one_time_work(self):
        work = self.engine.one_time_work()
        return {**work, "graphs": work["graphs"] + self.late}

    def align_prepared(self, pieces):
        texts = [text for text, _ in pieces]
        self.forwards.append(texts)
        self.late, self.capture_next = self.late + self.capture_next, 0
        self.entered.set()
        assert self.release.wait(60)
        if self.refuse in texts:
            raise ValueError("refused by the aligner")
        return self.engine.align_prepared([prepared for _, prepared in pieces])


def _server(loop, config: AlignerDeploymentConfig, engine=None) -> AlignerServer:
    server = AlignerServer.sync_init(config, engine)
    loop.run_until_complete(server.start())
    return server


def _pcm(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (3000 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.int16)


def _requests(n: int = 4) -> list[AlignRequest]:
    return [AlignRequest(f"r{i}", _pcm(0.5 + 0.4 * i, i), TEXTS[i % len(TEXTS)] + " again" * (i // len(TEXTS)), None)
            for i in range(n)]  # distinct texts: the spy knows a piece by its text


def _direct(aligner: Aligner, requests: list[AlignRequest]) -> list[list[Word]]:
    return aligner.align([r.pcm.astype(np.float32) / 32768.0 for r in requests], [r.text for r in requests],
                         SAMPLE_RATE)


async def _while_a_forward_holds(server, spy: Spy, requests: list[AlignRequest], waiting: int) -> list:
    """`requests` sent while a forward of another piece holds the aligner's thread, which is let go once `waiting`
    of them are prepared and wait: those are then timed together, as the batch bounds allow. Each call's answer
    or error."""
    spy.release.clear()
    spy.entered.clear()
    holder = asyncio.ensure_future(server.align(AlignRequest("holder", _pcm(0.5, 9), "holding the thread", None)))
    await asyncio.to_thread(spy.entered.wait, 60)
    calls = [asyncio.ensure_future(server.align(r)) for r in requests]
    while len(server._batches.waiting) < waiting:
        await asyncio.sleep(0.001)  # the pieces are being prepared on the server's threads
    spy.release.set()
    await holder
    return await asyncio.gather(*calls, return_exceptions=True)


def _timed_as_forwarded(aligner: Aligner, spy: Spy, requests: list[AlignRequest]) -> list[list[Word]]:
    """Each request's words as the aligner times it in the last forward the spy saw it in that did not fail (pieces
    are prepared on several threads: a forward holds them in the order they became ready)."""
    by_text, timed = {r.text: r for r in requests}, {}
    for forward in spy.forwards:
        if spy.refuse not in forward and all(t in by_text for t in forward):
            timed.update(zip(forward, _direct(aligner, [by_text[t] for t in forward]), strict=True))
    return [timed[r.text] for r in requests]


def test_the_embedded_aligner_starts_and_answers_like_the_aligner_it_loads(loop, tmp_path, monkeypatch):
    """`model: null`: the replica writes the tiny aligner once under the serve home and serves it."""
    from deployments import constants as C

    monkeypatch.setattr(C, "EMBEDDED_CHECKPOINT_DIR", tmp_path / "embedded")
    server = _server(loop, AlignerDeploymentConfig(device="cpu"))
    assert (tmp_path / "embedded" / "aligner-tiny" / "config.json").exists()
    assert isinstance(server._engine, AlignerEngineProtocol)
    info = loop.run_until_complete(server.info())
    assert info == AlignerInfo(max_seconds=400.0, languages=info.languages)
    assert "English" in info.languages and "Chinese" in info.languages and "Japanese" not in info.languages
    (request,) = _requests(1)
    words = loop.run_until_complete(server.align(request))
    assert words == _direct(Aligner.load(tmp_path / "embedded" / "aligner-tiny"), [request])[0]
    assert [w.word for w in words] == ["One", "two", "three"]
    server.check_health()
    server.__del__()


def test_concurrent_calls_share_forwards_with_the_aligners_answers(loop, aligner):
    """Pieces are prepared as they arrive, so concurrent calls share forwards in the order they became ready; each
    answer is what the aligner gives that piece in the batch it was timed in."""
    spy = Spy(aligner)
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False), spy)
    requests = _requests(4)

    async def together():
        return await asyncio.gather(*(server.align(r) for r in requests))

    answers = loop.run_until_complete(together())
    assert sorted(t for forward in spy.forwards for t in forward) == sorted(r.text for r in requests)
    assert answers == _timed_as_forwarded(aligner, spy, requests)
    stats = loop.run_until_complete(server.engine_stats())
    assert (stats["prepared"], stats["pieces"], stats["forwards"]) == (4, 4, len(spy.forwards))
    assert stats["audio_s"] == pytest.approx(sum(r.pcm.size for r in requests) / SAMPLE_RATE)
    assert stats["prepare_s"] > 0 and stats["forward_s"] > 0 and stats["queue_wait_s"] >= 0
    assert all(answers) and all(w.start <= w.end for words in answers for w in words)
    server.__del__()


def test_a_forward_that_captured_graphs_after_the_warm_up_is_counted_and_logged(loop, checkpoint, monkeypatch):
    """A shape the warm-up missed costs a request its capture (and, the first time, compiles): the replica counts
    the graphs captured in forwards once it is ready and logs what the forward held; the longest forward too. Its own
    aligner: the module's has met shapes in earlier tests, as the forwards that happened to form there decided."""
    from deployments import constants as C

    monkeypatch.setattr(C, "ALIGNER_SLOW_FORWARD_S", float("inf"))  # a loaded machine's slow forward logs too
    spy = Spy(Aligner.load(checkpoint))
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False), spy)
    lines: list[str] = []
    server._log = lines.append
    spy.capture_next = 3
    loop.run_until_complete(server.align(_requests(1)[0]))
    loop.run_until_complete(server.align(_requests(2)[1]))  # a forward capturing nothing: not logged
    stats = loop.run_until_complete(server.engine_stats())
    assert stats["late_graphs"] == 3 and stats["forwards"] == 2
    assert 0 < stats["max_forward_s"] <= stats["forward_s"]
    assert stats["late_traces"] == 0  # the CPU aligner compiles nothing
    assert stats["late_conv_shapes"] == 2  # no warm-up ran: each request met its own window length first
    assert stats["late_spectrogram_shapes"] == 2  # and its own spectrogram length (a cuFFT plan on CUDA)
    assert len(lines) == 1 and "in it 3 CUDA graphs captured, 0 functions traced" in lines[0] and "1 pieces" in lines[0]
    server.__del__()


def test_calls_arriving_during_a_forward_wait_and_share_the_next(loop, aligner):
    spy = Spy(aligner)
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False), spy)
    first, *rest = _requests(4)

    async def scenario():
        spy.release.clear()
        running = asyncio.ensure_future(server.align(first))
        await asyncio.to_thread(spy.entered.wait, 60)  # the first forward is on the aligner's thread
        waiting = [asyncio.ensure_future(server.align(r)) for r in rest]
        while len(server._batches.waiting) < len(rest):
            await asyncio.sleep(0)  # each call checks its piece, then waits for the aligner
        spy.release.set()
        return await running, await asyncio.gather(*waiting)

    alone, together = loop.run_until_complete(scenario())
    assert [sorted(f) for f in spy.forwards] == [[first.text], sorted(r.text for r in rest)]
    assert alone == _direct(aligner, [first])[0]
    assert together == _timed_as_forwarded(aligner, spy, rest)
    server.__del__()


def test_forwards_keep_to_the_batch_size_and_padded_audio_bounds(loop, aligner):
    assert plan_forwards([1, 1, 1, 1, 1], 2, 100) == [[0, 1], [2, 3], [4]]
    assert plan_forwards([10, 10, 30, 5], 8, 60) == [[0, 1], [2, 3]]  # 3 x 30 s > 60: the third starts anew
    assert plan_forwards([90, 1, 1], 8, 60) == [[0], [1, 2]]  # over the budget alone: a forward of its own
    assert plan_forwards([], 8, 60) == []
    spy = Spy(aligner)
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False, max_batch_size=2,
                                                   max_batch_audio_s=100), spy)
    requests = _requests(5)
    answers = loop.run_until_complete(_while_a_forward_holds(server, spy, requests, 5))
    assert [len(f) for f in spy.forwards[1:]] == [2, 2, 1]
    assert answers == _timed_as_forwarded(aligner, spy, requests)
    server.__del__()


@pytest.mark.parametrize("bad, code", [
    (AlignRequest("long", np.zeros(401 * SAMPLE_RATE, np.int16), "hello", None), "audio_too_long"),
    (AlignRequest("nan", np.full(SAMPLE_RATE, np.nan, np.float32), "hello", None), "cannot_align"),
    (AlignRequest("2d", np.zeros((2, SAMPLE_RATE), np.int16), "hello", None), "cannot_align"),
    (AlignRequest("ja", _pcm(1, 0), "こんにちは", "Japanese"), "unsupported_language"),
    (AlignRequest("xx", _pcm(1, 0), "hello", "Klingon"), "unsupported_language"),
    (AlignRequest("many", _pcm(1, 0), "a " * 5000, None), "text_too_long"),
    (AlignRequest("refused", _pcm(1, 0), "refuse me", "english"), "cannot_align"),  # the aligner's own refusal
])
def test_a_bad_piece_fails_alone_with_a_400(loop, aligner, bad, code):
    spy = Spy(aligner, refuse="refuse me")
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False), spy)
    good = _requests(3)
    refused_by_the_aligner = bad.request_id == "refused"
    first, error, *rest = loop.run_until_complete(
        _while_a_forward_holds(server, spy, [good[0], bad, *good[1:]], 4 if refused_by_the_aligner else 3))
    assert isinstance(error, APIError), error
    assert (error.status, error.code, error.param) == (400, code, "timestamps")
    texts = sorted(r.text for r in [good[0], bad, *good[1:]])
    if refused_by_the_aligner:  # the forward failed: each piece again alone
        shared, *alone = spy.forwards[1:]
        assert sorted(shared) == texts and sorted(alone) == [[t] for t in texts]
        assert [first, *rest] == [_direct(aligner, [r])[0] for r in good]
    else:  # refused before the forward: the good pieces share it
        assert [sorted(f) for f in spy.forwards[1:]] == [sorted(r.text for r in good)]
        assert [first, *rest] == _timed_as_forwarded(aligner, spy, good)
    assert server._pending == 0
    server.__del__()


def test_a_piece_with_nothing_to_time_is_answered_empty_without_a_forward(loop, aligner):
    spy = Spy(aligner)
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False), spy)
    shortest = aligner.min_samples(SAMPLE_RATE)
    empty = [
        AlignRequest("no text", _pcm(1, 0), "", None),
        AlignRequest("punctuation", _pcm(1, 0), " ... !!", "auto"),
        AlignRequest("too short", _pcm(1, 0)[:shortest - 1], "hello", None),
        AlignRequest("no audio", np.zeros(0, np.int16), "hello", "English"),
    ]
    for request in empty:
        assert loop.run_until_complete(server.align(request)) == []
    assert spy.forwards == []
    just_enough = AlignRequest("shortest", _pcm(1, 0)[:shortest], "hello", None)
    assert [w.word for w in loop.run_until_complete(server.align(just_enough))] == ["hello"]
    server.__del__()


def test_health_fails_when_pending_pieces_see_no_forward(loop, aligner):
    spy = Spy(aligner)
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False, stall_timeout_s=5), spy)
    now = [100.0]
    server._clock = lambda: now[0]
    now[0] += 1000  # idle for long: nothing pending, healthy
    server.check_health()

    async def scenario():
        spy.release.clear()
        call = asyncio.ensure_future(server.align(_requests(1)[0]))
        await asyncio.to_thread(spy.entered.wait, 60)
        now[0] += 4.9
        server.check_health()  # pending, within the timeout
        now[0] += 0.2
        with pytest.raises(RuntimeError, match="no progress"):
            server.check_health()
        spy.release.set()
        await call
        server.check_health()  # the forward finished: healthy again

    loop.run_until_complete(scenario())
    server.__del__()


def test_a_server_not_started_is_not_healthy(loop):
    server = AlignerServer.sync_init(AlignerDeploymentConfig(device="cpu"))
    with pytest.raises(RuntimeError, match="not running"):
        server.check_health()
    assert loop.run_until_complete(server.ready()) is False
