"""The aligner's CUDA graphs (stages/aligner/graphs.py) on a GPU: the graphed forward gives the eager forward's
timestamps, each bucket is captured once, and a replay with new inputs of the same bucket is not the last one's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.aligner import Aligner
from stages.aligner.random_checkpoint import write_random_aligner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TEXTS = ["One two three four five six", "你好，世界，今天天气很好", "Hello world again and again", "a b c d"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_aligner(tmp_path_factory.mktemp("aligner"), tiny=False, dtype="bfloat16", device="cuda",
                                log=lambda *_: None)


def _batch(n: int, seed: int, seconds: float = 6.0):
    rng = np.random.default_rng(seed)
    audio = [(0.1 * rng.standard_normal(int((seconds - 0.7 * i) * 24000))).astype(np.float32) for i in range(n)]
    return audio, [TEXTS[i % len(TEXTS)] for i in range(n)]


def test_graphed_forwards_time_as_eager_ones_and_capture_each_bucket_once(checkpoint):
    eager = Aligner.load(checkpoint, "cuda", "bfloat16", graphs=False)
    graphed = Aligner.load(checkpoint, "cuda", "bfloat16")
    assert eager.runners is None and graphed.runners is not None
    for n, seed in ((1, 0), (3, 1), (8, 2), (3, 3), (8, 4)):  # the repeats reuse their buckets on new inputs
        audio, texts = _batch(n, seed)
        a = eager.logits(eager.prepare(audio, texts, 24000)).float()
        b = graphed.logits(graphed.prepare(audio, texts, 24000)).float()
        assert a.shape == b.shape
        # bf16, and padded shapes can take other GEMM kernels: the same logits within bf16's rounding
        assert float((a - b).abs().max()) < 0.25, (n, seed)
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.95, (n, seed)
    captured = graphed.runners.captured
    audio, texts = _batch(3, 5)
    graphed.align(audio, texts, 24000)
    assert graphed.runners.captured == captured  # a bucket met before: no new capture
