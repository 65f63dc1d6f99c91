"""The aligner's CUDA graphs (stages/aligner/graphs.py) on a GPU."""

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


def test_replayed_graphs_compute_what_the_same_padded_shapes_compute_eagerly(checkpoint):
    """Padding itself is checked on a CPU in fp32 (tests/stages/test_aligner.py); here, in bf16 on CUDA, a replayed
    graph gives what the same padded shapes give eagerly, for new inputs of a bucket met before too (not the last
    replay's), and each bucket is captured once."""
    from stages.aligner.graphs import AlignerGraphs

    graphed = Aligner.load(checkpoint, "cuda", "bfloat16")
    padded = Aligner(graphed.model, graphed.tokenizer)
    padded.runners = AlignerGraphs(padded.model, capture=False)
    assert graphed.runners is not None
    for n, seed in ((1, 0), (3, 1), (8, 2), (3, 3), (8, 4)):  # the repeats reuse their buckets on new inputs
        audio, texts = _batch(n, seed)
        a = padded.logits(padded.prepare(audio, texts, 24000)).float()
        b = graphed.logits(graphed.prepare(audio, texts, 24000)).float()
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 0.05 * max(float(a.abs().max()), 1.0), (n, seed)
        assert float((a.argmax(-1) == b.argmax(-1)).float().mean()) > 0.999, (n, seed)
    captured = graphed.runners.captured
    audio, texts = _batch(3, 5)
    graphed.align(audio, texts, 24000)
    assert graphed.runners.captured == captured  # a bucket met before: no new capture


def test_warm_up_captures_what_a_servers_forwards_meet(checkpoint):
    """A server warms up for its batch size and padded audio (AlignerServer.start): forwards within them then
    capture nothing (no request pays a compile or a capture), and most word times are within one class of the
    uncompiled eager forward's. Random weights give near-flat logits whose argmax flips under any change of bf16
    rounding (fused kernels round elsewhere): the exact equality of the kernels path is checked in fp32 on a CPU
    (tests/stages/test_aligner.py)."""
    graphed = Aligner.load(checkpoint, "cuda", "bfloat16")
    captured = graphed.warm_up(8, 60.0)
    assert captured == graphed.runners.captured > 0
    eager = Aligner.load(checkpoint, "cuda", "bfloat16", graphs=False)
    agree = total = 0
    for n, seconds in ((1, 6.0), (3, 2.5), (8, 6.0), (5, 7.5)):
        audio, texts = _batch(n, n, seconds)
        a = graphed.align(audio, texts, 24000)
        b = eager.align(audio, texts, 24000)
        for wa, wb in zip(a, b, strict=True):
            assert [w.word for w in wa] == [w.word for w in wb]
            agree += sum(abs(x.start - y.start) <= 0.08 and abs(x.end - y.end) <= 0.08 for x, y in zip(wa, wb, strict=True))
            total += len(wa)
    assert graphed.runners.captured == captured
    assert agree >= 0.85 * total, (agree, total)
