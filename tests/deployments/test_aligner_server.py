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
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()

    def min_samples(self, sample_rate):
        return self.engine.min_samples(sample_rate)

    def align(self, audios, texts, sample_rate, languages=None):
        self.forwards.append(list(texts))
        self.entered.set()
        assert self.release.wait(60)
        if self.refuse in texts:
            raise ValueError("refused by the aligner")
        return self.engine.align(audios, texts, sample_rate, languages)


def _server(loop, config: AlignerDeploymentConfig, engine=None) -> AlignerServer:
    server = AlignerServer.sync_init(config, engine)
    loop.run_until_complete(server.start())
    return server


def _pcm(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (3000 * rng.standard_normal(int(seconds * SAMPLE_RATE))).astype(np.int16)


def _requests(n: int = 4) -> list[AlignRequest]:
    return [AlignRequest(f"r{i}", _pcm(0.5 + 0.4 * i, i), TEXTS[i % len(TEXTS)], None) for i in range(n)]


def _direct(aligner: Aligner, requests: list[AlignRequest]) -> list[list[Word]]:
    return aligner.align([r.pcm.astype(np.float32) / 32768.0 for r in requests], [r.text for r in requests],
                         SAMPLE_RATE)


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


def test_concurrent_calls_are_one_forward_with_the_aligners_answers(loop, aligner):
    spy = Spy(aligner)
    server = _server(loop, AlignerDeploymentConfig(device="cpu", warmup=False), spy)
    requests = _requests(4)

    async def together():
        return await asyncio.gather(*(server.align(r) for r in requests))

    answers = loop.run_until_complete(together())
    assert spy.forwards == [[r.text for r in requests]]
    assert answers == _direct(aligner, requests)
    assert all(answers) and all(w.start <= w.end for words in answers for w in words)
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
    assert spy.forwards == [[first.text], [r.text for r in rest]]
    assert alone == _direct(aligner, [first])[0]
    assert together == _direct(aligner, rest)
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

    async def together():
        return await asyncio.gather(*(server.align(r) for r in requests))

    answers = loop.run_until_complete(together())
    assert [len(f) for f in spy.forwards] == [2, 2, 1]
    assert answers == [*_direct(aligner, requests[:2]), *_direct(aligner, requests[2:4]), *_direct(aligner, requests[4:])]
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

    async def together():
        return await asyncio.gather(*(server.align(r) for r in [good[0], bad, *good[1:]]), return_exceptions=True)

    first, error, *rest = loop.run_until_complete(together())
    assert isinstance(error, APIError), error
    assert (error.status, error.code, error.param) == (400, code, "timestamps")
    if bad.request_id == "refused":  # the forward failed: each piece again alone
        assert spy.forwards[1:] == [[r.text] for r in [good[0], bad, *good[1:]]]
        assert [first, *rest] == [_direct(aligner, [r])[0] for r in good]
    else:  # refused before the forward: the good pieces share it
        assert spy.forwards == [[r.text for r in good]]
        assert [first, *rest] == _direct(aligner, good)
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
