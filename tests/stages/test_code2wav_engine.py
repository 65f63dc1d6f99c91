"""Code2Wav engine + chunker: exactness (whole utterance, first chunk, batched), schedules, pinned fidelity.

CPU, fp32, the tiny random checkpoint of tests/conftest.py. The tiny decoder has 2 attention layers, so
its receptive field is 154 frames (580 for the released 8 layers); the pinned fidelity bound for the
default left context comes from the full-size study in docs/code2wav.md.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from stages.chunking import ChunkSchedule, StreamChunker, receptive_field_frames
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.contract import CodecChunk, FinishReason
from tests.code2wav_reference import decode_chunks

SPF = 1920
TOL = 1e-5
STREAM_FRAMES = 180

# The study (docs/code2wav.md; released decoder shapes, random weights, fp32, default schedule, left context
# 25, 4 x 500 frames on an H100) measured SNR 64.0 dB overall, 61.8 dB in the worst chunk, max |err| 1.4e-4
# (peak 0.1). The tiny decoder here measures 84.7 dB / 1.6e-4 (peak ~0.6). Pinned: the study's bound.
DEFAULT_CONTEXT_MIN_SNR_DB = 60.0
DEFAULT_CONTEXT_MAX_ABS = 3e-4


def snr_db(ref: np.ndarray, out: np.ndarray) -> float:
    noise = float(np.sum((out.astype(np.float64) - ref) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)


@pytest.fixture(scope="module")
def decoder(tiny_custom_voice):
    from stages.qwen3_tts import Qwen3TTS

    model = Qwen3TTS.load(tiny_custom_voice, "cpu", "float32", talker=False, decoder=True, voice=False)
    return model.decoder


@pytest.fixture(scope="module")
def engine(decoder) -> Code2WavEngine:
    eng = Code2WavEngine(decoder, Code2WavEngineConfig(stateful=False))
    eng.warmup(log=lambda _m: None)
    return eng


@pytest.fixture(scope="module")
def stream() -> np.ndarray:  # [STREAM_FRAMES, 16]
    return np.random.default_rng(7).integers(0, 2048, (STREAM_FRAMES, 16), dtype=np.int64)


@pytest.fixture(scope="module")
def full(decoder, stream) -> np.ndarray:
    """Whole-stream decode; by causality its first n*1920 samples are the decode of the first n frames."""
    with torch.inference_mode():
        return decoder(torch.from_numpy(stream).T[None])[0, 0].numpy()


def reassemble(engine: Code2WavEngine, chunks: list[CodecChunk]) -> np.ndarray:
    return np.concatenate(engine.decode(chunks))


def stream_chunks(schedule: ChunkSchedule, frames: np.ndarray, ref=None, pushes=(7, 1, 30)) -> list[CodecChunk]:
    """Push frames in uneven blocks (as the talker delivers them), then flush."""
    chunker = StreamChunker(schedule, "req", ref_codes=ref)
    out, i, k = [], 0, 0
    while i < len(frames):
        n = pushes[k % len(pushes)]
        out += chunker.push(frames[i:i + n])
        i, k = i + n, k + 1
    return [*out, chunker.flush(FinishReason.EOS)]


# ---- schedule ------------------------------------------------------------------------------------------


def test_default_schedule_sizes_and_plan():
    s = ChunkSchedule()
    assert [s.chunk_frames(i) for i in range(7)] == [2, 4, 8, 16, 25, 25, 25]
    assert s.left_context_frames == 25
    assert s.plan(125) == [(0, 2), (2, 4), (6, 8), (14, 16), (25, 25), (25, 25), (25, 25), (25, 20)]
    assert s.decode_lengths() == [2, 6, 14, 30, 50]
    assert ChunkSchedule(left_context_frames=50).decode_lengths() == [2, 6, 14, 30, 55, 75]
    assert ChunkSchedule(ramp=()).plan(30) == [(0, 2), (2, 25), (25, 3)]
    assert ChunkSchedule(ramp=[4, 8], left_context_frames=5).plan(40) == [(0, 2), (2, 4), (5, 8), (5, 25), (5, 1)]
    assert ChunkSchedule(ramp_factor=1.5, first_chunk_frames=4).plan(20)[:4] == [(0, 4), (4, 6), (10, 9), (19, 1)]
    assert ChunkSchedule(left_context_frames=0).context_overhead(1000) == 1.0
    assert ChunkSchedule().context_overhead(10**4) == pytest.approx(2.0, abs=0.01)
    assert ChunkSchedule(left_context_frames=25).plan(6, ref_frames=100) == [(25, 2), (25, 4), (0, 0)]
    assert ChunkSchedule(left_context_frames=25, ref_context_frames=0).plan(6, ref_frames=100) == [(0, 2), (25, 4), (0, 0)]
    assert ChunkSchedule().plan(0) == [(0, 0)]


@pytest.mark.parametrize("bad", [
    dict(first_chunk_frames=0), dict(steady_chunk_frames=0), dict(left_context_frames=-1),
    dict(ramp_factor=1.0), dict(ramp=(4, 0)), dict(ref_context_frames=-2),
])
def test_schedule_validation(bad):
    with pytest.raises(ValueError):
        ChunkSchedule(**bad)


@pytest.mark.parametrize("total", [0, 1, 2, 3, 25, 55, 56, 125])
@pytest.mark.parametrize("ref", [0, 30])
def test_chunker_follows_plan(total, ref):
    s = ChunkSchedule(left_context_frames=20)
    frames = np.arange(total * 16, dtype=np.int64).reshape(total, 16) % 2048
    ref_codes = (np.arange(ref * 16).reshape(ref, 16) + 1000) % 2048 if ref else None
    chunks = stream_chunks(s, frames, ref_codes)
    assert [(c.context, c.num_new) for c in chunks] == s.plan(total, ref)
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.final for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].finish_reason is FinishReason.EOS
    history = np.concatenate([ref_codes, frames]) if ref else frames
    done = ref
    for c in chunks:  # codes = the context frames right before the new ones, then the new ones
        assert c.codes.dtype == np.int64 and c.codes.shape == (c.context + c.num_new, 16)
        np.testing.assert_array_equal(c.codes, history[done - c.context:done + c.num_new])
        done += c.num_new


def test_chunker_edge_cases():
    one = np.full((1, 16), 5)
    chunker = StreamChunker(ChunkSchedule(), "one")
    assert chunker.push(one) == []  # first chunk is 2 frames
    last = chunker.flush(FinishReason.LENGTH)
    assert (last.final, last.context, last.num_new, last.seq) == (True, 0, 1, 0)
    assert chunker.flush() is None  # a second flush gives nothing
    with pytest.raises(RuntimeError):
        chunker.push(one)

    empty = StreamChunker(ChunkSchedule(), "empty").flush(FinishReason.ABORTED)  # 0 frames: an empty final chunk
    assert empty.final and empty.num_new == 0 and empty.codes.shape == (0, 16) and empty.context == 0

    steady = ChunkSchedule(first_chunk_frames=25, ramp=())
    chunker = StreamChunker(steady, "exact")
    [chunk] = chunker.push(np.zeros((25, 16), dtype=np.int64))  # exactly one steady chunk
    assert not chunk.final and chunk.num_new == 25
    last = chunker.flush(FinishReason.EOS)
    assert last.final and last.num_new == 0 and last.seq == 1

    assert len(StreamChunker(ChunkSchedule(), "single").push(np.zeros(16, dtype=np.int32))) == 0  # one [16] frame
    for bad in (np.zeros((2, 15)), np.full((2, 16), 2048), np.full((2, 16), -1), np.zeros((2, 16), dtype=np.float32)):
        with pytest.raises(ValueError):
            StreamChunker(ChunkSchedule(), "bad").push(bad)
    with pytest.raises(ValueError):
        StreamChunker(ChunkSchedule(), "bad", ref_codes=np.zeros((3, 8)))


def test_replace_keeps_validation():
    s = dataclasses.replace(ChunkSchedule(), first_chunk_frames=40)  # the talker's per-request override
    assert s.plan(60) == [(0, 40), (25, 20)]
    with pytest.raises(ValueError):
        dataclasses.replace(ChunkSchedule(), first_chunk_frames=0)


# ---- exactness -----------------------------------------------------------------------------------------


def test_whole_utterance_single_chunk_equals_full_decode(engine, stream, full):
    [wav] = engine.decode([CodecChunk("r", 0, stream[:60], 0, final=True)])
    assert wav.dtype == np.float32 and wav.shape == (60 * SPF,)
    assert np.abs(wav - full[:60 * SPF]).max() <= TOL
    assert np.abs(full).max() > 1e-2  # not a silent decoder


@pytest.mark.parametrize("first", [1, 2, 4])
def test_first_chunk_is_exact(engine, stream, full, first):
    chunks = stream_chunks(ChunkSchedule(first_chunk_frames=first), stream[:first + 3])
    [wav] = engine.decode(chunks[:1])
    assert chunks[0].context == 0 and wav.shape == (first * SPF,)
    assert np.abs(wav - full[:first * SPF]).max() <= TOL


def test_icl_reference_is_left_context(engine, decoder, stream):
    """Base ICL: the official decode runs cat(ref, generated) and cuts the reference's samples."""
    ref, gen = stream[:40], stream[40:52]
    with torch.inference_mode():
        official = decoder(torch.from_numpy(np.concatenate([ref, gen])).T[None])[0, 0, 40 * SPF:].numpy()
    chunks = stream_chunks(ChunkSchedule(left_context_frames=50), gen, ref=ref)
    assert chunks[0].context == 40  # the whole reference fits the context: the first chunk is exact
    wav = engine.decode(chunks)
    assert np.abs(wav[0] - official[:2 * SPF]).max() <= TOL
    assert np.abs(np.concatenate(wav) - official).max() <= TOL  # context covers everything: all exact
    chunks = stream_chunks(ChunkSchedule(left_context_frames=20, ref_context_frames=8), gen, ref=ref)
    assert chunks[0].context == 8 and chunks[1].context == 20  # later chunks: context from ref + generated
    np.testing.assert_array_equal(chunks[1].codes[:20], np.concatenate([ref[-18:], gen[:2]]))


def test_stream_exact_once_context_covers_receptive_field(engine, decoder, stream, full):
    rf = receptive_field_frames(decoder.cfg)
    assert rf == 154  # 2 + 2 layers x 71 + conv tail
    start = STREAM_FRAMES - 20
    exact, short = engine.decode([CodecChunk("r", 1, stream[start - rf:], rf), CodecChunk("r", 1, stream[start - 72:], 72)])
    diff, diff72 = np.abs(exact - full[start * SPF:]).max(), np.abs(short - full[start * SPF:]).max()
    print(f"\nmax |chunk - full| with left context {rf} (receptive field): {diff:.2e}; with 72: {diff72:.2e}")
    assert diff <= TOL


def test_default_context_fidelity_is_pinned(engine, stream, full):
    """The default schedule on a 100-frame stream: the error of stateless chunking stays in the study's bound."""
    schedule = ChunkSchedule()
    chunks = stream_chunks(schedule, stream[:100])
    out = reassemble(engine, chunks)
    ref = full[:100 * SPF]
    snr, max_abs = snr_db(ref, out), float(np.abs(out - ref).max())
    print(f"\ndefault schedule (left context {schedule.left_context_frames}): SNR {snr:.1f} dB, max|err| {max_abs:.2e}")
    assert snr >= DEFAULT_CONTEXT_MIN_SNR_DB and max_abs <= DEFAULT_CONTEXT_MAX_ABS
    # and context matters: without it the same stream is far worse
    no_ctx = reassemble(engine, stream_chunks(dataclasses.replace(schedule, left_context_frames=0), stream[:100]))
    assert snr_db(ref, no_ctx) < snr - 20


def test_batched_equals_one_by_one(engine, decoder, stream):
    rng = np.random.default_rng(3)
    shapes = [(0, 2), (0, 1), (50, 25), (2, 4), (30, 25), (0, 0), (14, 16), (50, 7), (60, 40)]
    chunks = [CodecChunk(f"s{i}", 0, rng.integers(0, 2048, (c + n, 16)), c) for i, (c, n) in enumerate(shapes)]
    batched = engine.decode(chunks)
    for c, b in zip(chunks, batched, strict=True):
        [alone] = engine.decode([c])
        assert b.shape == alone.shape == (c.num_new * SPF,)
        assert np.abs(b - alone).max(initial=0.0) <= TOL
    with torch.inference_mode():  # and the reference path agrees
        ref = decode_chunks(decoder, [(torch.from_numpy(c.codes), c.context) for c in chunks if c.num_new])
    for b, r in zip([b for c, b in zip(chunks, batched, strict=True) if c.num_new], ref, strict=True):
        assert np.abs(b - r.numpy()).max() <= TOL


# ---- engine mechanics ----------------------------------------------------------------------------------


def test_plan_buckets_limits_and_coverage(decoder):
    cfg = Code2WavEngineConfig(stateful=False, max_batch_size=8, batch_buckets=(1, 2, 4, 8), length_buckets=(2, 6, 30, 75),
                               max_frames_per_forward=300, forward_overhead_frames=10)
    eng = Code2WavEngine(decoder, cfg)
    lengths = [2, 75, 75, 6, 5, 75, 1, 2, 30, 75, 75, 75, 75, 75, 200]
    eager = eng._plan(lengths)  # no graphs: exact lengths, no batch padding
    assert sorted(i for idx, _, _ in eager for i in idx) == list(range(len(lengths)))
    for idx, b, t in eager:
        assert b == len(idx) and t == max(lengths[i] for i in idx)
        assert b * t <= 300 or b == 1
    eng._graphs = {s: None for s in eng.graph_shapes()}  # pretend graphs were captured
    assert (8, 75) not in eng._graphs and (4, 75) in eng._graphs  # 8 x 75 > 300 frames
    graphed = eng._plan(lengths)
    assert sorted(i for idx, _, _ in graphed for i in idx) == list(range(len(lengths)))
    for idx, b, t in graphed:
        assert len(idx) <= b and max(lengths[i] for i in idx) <= t
        assert (b, t) in eng._graphs or (t == 200 and b == len(idx))  # longer than every bucket: eager


def test_stats_and_validation(decoder):
    eng = Code2WavEngine(decoder, Code2WavEngineConfig(stateful=False))
    rng = np.random.default_rng(0)
    ok = CodecChunk("a", 0, rng.integers(0, 2048, (7, 16)), 3)
    out = eng.decode([ok, CodecChunk("b", 1, np.zeros((0, 16), dtype=np.int64), 0, final=True)])
    assert out[0].shape == (4 * SPF,) and out[1].shape == (0,)
    s = eng.stats()
    assert (s.batches, s.chunks, s.new_frames, s.decoded_frames, s.forwards, s.graphs, s.queued) == (1, 2, 4, 7, 1, 0, 0)
    bad = [
        CodecChunk("x", 0, np.full((3, 16), 2048), 0),  # code out of range
        CodecChunk("x", 0, np.full((3, 16), -1), 0),
        CodecChunk("x", 0, np.zeros((3, 8), dtype=np.int64), 0),  # wrong codebook count
        CodecChunk("x", 0, np.zeros((3, 16), dtype=np.int64), 4),  # context beyond the codes
        CodecChunk("x", 0, np.zeros((3, 16), dtype=np.float32), 0),
    ]
    for chunk in bad:
        with pytest.raises(ValueError):
            eng.decode([ok, chunk])
    assert eng.stats().batches == 1  # rejected before any work
    assert eng.decode([]) == []


def test_compile_is_cuda_only(decoder):
    """`compile` on a CPU engine keeps the eager modules (the exact path): the same samples as without it."""
    from stages.code2wav import compiled

    rng = np.random.default_rng(5)
    chunks = [CodecChunk("c", 0, rng.integers(0, 2048, (6, 16)), 2), CodecChunk("d", 0, rng.integers(0, 2048, (3, 16)), 0)]
    plain = Code2WavEngine(decoder, Code2WavEngineConfig(stateful=False, max_batch_size=8)).decode(chunks)
    eng = Code2WavEngine(decoder, Code2WavEngineConfig(stateful=False, max_batch_size=8, compile=True,
                                                       compile_cache_dir="/nonexistent"))
    assert eng.compiled is False and not compiled.is_enabled(decoder)
    assert "forward" not in vars(decoder.quantizer) and "forward" not in vars(decoder.pre_transformer)
    for a, b in zip(eng.decode(chunks), plain, strict=True):
        np.testing.assert_array_equal(a, b)
    assert eng.compile_cache() is None  # nothing compiled: no cache file read or written


def test_config_from_lists_and_schedule():
    cfg = Code2WavEngineConfig(stateful=False, batch_buckets=[1, 4], length_buckets=[2, 75])
    assert cfg.batch_buckets == (1, 4) and cfg.length_buckets == (2, 75)
    assert Code2WavEngineConfig(stateful=False).length_buckets == (2, 6, 14, 30, 50)
    wide = Code2WavEngineConfig.for_schedule(ChunkSchedule(left_context_frames=50), stateful=False)
    assert wide.length_buckets == (2, 6, 14, 30, 55, 75)
    with pytest.raises(ValueError):
        Code2WavEngineConfig(stateful=False, max_batch_size=0)


# ---- CUDA graphs (GPU only) ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("fast_kernels", "compile"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_and_fast_kernels_match_eager(decoder, dtype, fast_kernels, compile, monkeypatch):
    import copy

    from stages.code2wav import fast

    monkeypatch.setattr(fast, "UPSAMPLE_GEMM_MIN_CHANNELS", 32)  # its blocks 0-1 as GEMMs, 2-3 as cuDNN's
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = Code2WavEngineConfig.for_schedule(ChunkSchedule(left_context_frames=50), stateful=False, max_batch_size=8,
                                            batch_buckets=(1, 2, 4, 8), max_frames_per_forward=300,
                                            fast_kernels=fast_kernels, compile=compile)
    graphed = Code2WavEngine(copy.deepcopy(decoder).to("cuda", dtype), cfg)
    assert graphed.fast_kernels == fast_kernels and graphed.compiled == compile
    graphed.warmup(log=print)
    assert graphed.stats().graphs == len(graphed.graph_shapes()) > 0
    eager = Code2WavEngine(copy.deepcopy(decoder).to("cuda", dtype),
                           Code2WavEngineConfig(stateful=False, cuda_graphs=False, fast_kernels=False, max_batch_size=8))
    rng = np.random.default_rng(1)
    shapes = [(0, 2), (2, 4), (50, 25), (0, 1), (30, 25), (50, 25), (50, 25), (50, 25), (50, 25), (50, 13), (90, 10)]
    chunks = [CodecChunk(f"s{i}", 0, rng.integers(0, 2048, (c + n, 16)), c) for i, (c, n) in enumerate(shapes)]
    for _ in range(2):  # twice: replays must not leak state between calls
        g = graphed.decode(chunks)
        e = eager.decode(chunks)
        for a, b in zip(g, e, strict=True):
            diff = float(np.abs(a - b).max())
            print(f"{dtype} fast={fast_kernels} compile={compile}: max diff {diff:.2e}, SNR {snr_db(b, a):.1f} dB")
            assert diff <= (1e-4 if dtype == torch.float32 else 3e-2), diff
            assert snr_db(b, a) > (80 if dtype == torch.float32 else 30)
    s = graphed.stats()
    assert s.graph_forwards >= 1 and s.forwards > s.graph_forwards  # (90, 10) is longer than every bucket
