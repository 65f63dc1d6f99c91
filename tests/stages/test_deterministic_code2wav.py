"""Deterministic mode of the Code2Wav engine (CPU, fp32, tiny random checkpoint): a stream's PCM is bit-identical
decoded alone and co-batched with 1, 7 and many other streams' chunks of other lengths, stateful and stateless, and
every forward has its chunks' own length bucket and that bucket's one batch size; with the batch-invariant
convolutions (stages/invariant_conv.py, here on the CPU key; on CUDA the engine's own) a probe's PCM is the same at
every row of a full forward and close to the default engine's."""

from __future__ import annotations

import numpy as np
import pytest

from stages import invariant_conv
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


def _engine(decoder, stateful: bool, max_frames_per_forward: int = 120, deterministic: bool = True) -> Code2WavEngine:
    config = Code2WavEngineConfig.for_schedule(SCHEDULE, stateful=stateful, max_batch_size=6,
                                               max_frames_per_forward=max_frames_per_forward,
                                               deterministic=deterministic)
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


@pytest.mark.parametrize("stateful", [True, False], ids=["stateful", "stateless"])
def test_with_invariant_convolutions_a_probe_decodes_alike_at_every_row(decoder, stateful, monkeypatch):
    calls = []
    convolution = invariant_conv.convolution
    monkeypatch.setattr(invariant_conv, "DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(invariant_conv, "convolution", lambda *a: calls.append(a[6]) or convolution(*a))
    fallbacks = invariant_conv.fallbacks
    engine = _engine(decoder, stateful, max_frames_per_forward=6 * 50)  # every bucket's forward: 6 rows
    assert engine.invariant_convs and all(b == 6 for b, _ in engine.graph_shapes())

    def decode(tag: str, row: int | None) -> np.ndarray:
        """The probe's PCM, each of its chunks at `row` of a full forward beside 5 other streams' chunks of its
        length (None: alone, beside padding rows)."""
        crowd = [_chunks(f"{tag}-o{i}", 200 + i) for i in range(5)] if row is not None else []
        pcm = []
        for k, chunk in enumerate(_chunks(f"{tag}-probe", 7)):
            batch = [s[k] for s in crowd]
            at = row or 0
            pcm.append(engine.decode([*batch[:at], chunk, *batch[at:]])[at])
        return np.concatenate(pcm)

    alone = decode("alone", None)
    assert calls and not invariant_conv.enabled(), "the engine's decode went through the override, then let go"
    for row in (0, 1, 3, 5):
        assert np.array_equal(decode(f"row{row}", row), alone), f"row {row}"
    assert invariant_conv.fallbacks == fallbacks
    calls.clear()
    default = _engine(decoder, stateful, max_frames_per_forward=6 * 50, deterministic=False)
    assert not default.invariant_convs
    reference = np.concatenate([default.decode([c])[0] for c in _chunks("default-probe", 7)])
    assert not calls  # aten's convolutions
    np.testing.assert_allclose(alone, reference, atol=1e-5)  # fp32: summation order only
