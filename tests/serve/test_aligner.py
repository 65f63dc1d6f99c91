"""The Aligner deployment in real Serve, called through a handle as the ingress calls it: pieces sent together are
timed in one forward, a refused piece reaches the caller as its APIError 400 (pickled whole through Ray) while the
others are answered, and `info` describes it."""

from __future__ import annotations

import numpy as np
import pytest

from deployments.errors import APIError, to_api_error
from deployments.messages import AlignerInfo, AlignRequest
from stages.aligner import Word
from stages.contract import SAMPLE_RATE
from tests.serve.conftest import APP

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def aligner(serve_app):
    """The session app's Aligner deployment (tests/serve/conftest.py), called as its ingress calls it."""
    from ray import serve

    return serve.get_deployment_handle("Aligner", app_name=APP)


def _pcm(seconds: float, seed: int) -> np.ndarray:
    return (3000 * np.random.default_rng(seed).standard_normal(int(seconds * SAMPLE_RATE))).astype(np.int16)


def test_pieces_are_timed_and_a_refused_one_fails_alone_with_its_400(aligner):
    info = aligner.info.remote().result(timeout_s=60)
    assert isinstance(info, AlignerInfo) and info.max_seconds == 400.0 and "English" in info.languages
    good = [AlignRequest(f"g{i}", _pcm(1 + i, i), "Hello there, world.", "English") for i in range(3)]
    bad = AlignRequest("b", np.zeros(401 * SAMPLE_RATE, np.int16), "hello", None)
    responses = [aligner.align.remote(r) for r in [good[0], bad, *good[1:]]]
    with pytest.raises(Exception) as raised:
        responses[1].result(timeout_s=120)
    error = to_api_error(raised.value)
    assert isinstance(error, APIError)
    assert (error.status, error.code, error.param) == (400, "audio_too_long", "timestamps")
    for response in responses[:1] + responses[2:]:
        words = response.result(timeout_s=120)
        assert [w.word for w in words] == ["Hello", "there", "world"] and all(isinstance(w, Word) for w in words)
    silence = AlignRequest("s", np.zeros(0, np.int16), "hello", None)
    assert aligner.align.remote(silence).result(timeout_s=60) == []
