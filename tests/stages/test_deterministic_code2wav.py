"""Deterministic mode of the Code2Wav engine (CPU, fp32, tiny random checkpoint): a stream's PCM is bit-identical
decoded alone and co-batched with 1, 7 and many other streams' chunks of other lengths, stateful and stateless, and
every forward has its chunks' own length bucket and that bucket's one batch size."""

from __future__ import annotations

import numpy as np
import pytest

from stages.chunking import ChunkSchedule, StreamChunker
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig

SCHEDULE = ChunkSchedule()
FRAMES = 24


@pytest.fixture(scope="module")
def decoder(tiny_custom_voice):
    from stages.qwen3_tts import Qwen3TTS

    return Qwen3TTS.load(tiny_custom_voice, "cpu", "float32", talker=False, decoder=True, voice=False).decoder


def _chunks(request_id: str, seed: int, frames: int = FRAMES):
    codes = np.random.default_rng(seed).integers(0, 2048, (frames, 16), dtype=np.int64)
    chunker = StreamChunker(SCHEDULE, request_id)
    chunks = chunker.push(codes)
    last = chunker.flush()
    return chunks + ([last] if last is not None else [])


def _engine(decoder, stateful: bool) -> Code2WavEngine:
    config = Code2WavEngineConfig.for_schedule(SCHEDULE, stateful=stateful, max_batch_size=6,
                                               max_frames_per_forward=120, deterministic=True)
    engine = Code2WavEngine(decoder, config)
    engine.warmup(log=lambda _m: None)
    return engine


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])
def test_pcm_is_bit_identical_alone_and_in_any_batch(decoder, stateful, monkeypatch):
    engine = _engine(decoder, stateful)
    shapes: list[tuple[int, int]] = []
    forward = engine._forward

    def recording(items, b_pad, t_pad):
        shapes.append((b_pad, t_pad))
        return forward(items, b_pad, t_pad)

    monkeypatch.setattr(engine, "_forward", recording)

    def decode(target_id: str, others: int) -> np.ndarray:
        """The target stream's PCM, each of its chunks decoded in one call with `others` streams' chunks, which
        start at other chunks of their own streams (other lengths, first chunks and continued ones mixed)."""
        target = _chunks(target_id, 1)
        streams = [_chunks(f"{target_id}-o{i}", 100 + i, FRAMES + 3 * i) for i in range(others)]
        pcm = []
        for k, chunk in enumerate(target):
            batch = [s[k - i % 3] for i, s in enumerate(streams) if 0 <= k - i % 3 < len(s)]  # some start later
            out = engine.decode([*batch[:len(batch) // 2], chunk, *batch[len(batch) // 2:]])
            pcm.append(out[len(batch) // 2])
        return np.concatenate(pcm)

    alone = decode("alone", 0)
    assert alone.shape == (FRAMES * 1920,)
    for others in (1, 7, 13):
        assert np.array_equal(decode(f"with-{others}", others), alone), f"with {others} others"
    cfg = engine.config
    assert shapes and all(b == cfg.fixed_batch(t, engine.min_size) for b, t in shapes), shapes
    assert {t for _, t in shapes} <= set(engine.length_buckets)


def test_graph_shapes_are_one_batch_per_length_bucket(decoder):
    config = Code2WavEngineConfig(length_buckets=(2, 6, 14, 30, 50), max_batch_size=64, max_frames_per_forward=4096,
                                  deterministic=True)
    engine = Code2WavEngine(decoder, config)
    assert engine.graph_shapes() == [(64, 2), (64, 6), (64, 14), (64, 30), (64, 50)]
    default = Code2WavEngine(decoder, Code2WavEngineConfig(length_buckets=(2, 6), max_batch_size=4))
    assert len(default.graph_shapes()) > 2
