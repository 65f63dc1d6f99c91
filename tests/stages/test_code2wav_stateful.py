"""Stateful Code2Wav decoding: chunks continued from their stream's carried state equal the whole decode.

CPU, fp32, the tiny random checkpoint. The stream (180 frames) is longer than the tiny decoder's receptive
field (154 frames), so a left-context decode is only approximate there while the stateful one is exact; the
misses (first chunk, gaps, late chunks, eviction, failures) decode exactly as the stateless engine does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stages.chunking import ChunkSchedule, StreamChunker
from stages.code2wav.engine import Code2WavEngine, Code2WavEngineConfig
from stages.code2wav.stateful import DecoderStates, StatefulDecoder, carried_convs
from stages.code2wav.stream_slots import StreamSlots
from stages.contract import CodecChunk, FinishReason

SPF = 1920
TOL = 1e-5
STREAM_FRAMES = 180
FIRST_1 = ChunkSchedule(first_chunk_frames=1)  # the serving configs' schedule


@pytest.fixture(scope="module")
def decoder(tiny_custom_voice):
    from stages.qwen3_tts import Qwen3TTS

    return Qwen3TTS.load(tiny_custom_voice, "cpu", "float32", talker=False, decoder=True, voice=False).decoder


@pytest.fixture(scope="module")
def streams() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(0, 2048, (n, 16), dtype=np.int64) for n in (STREAM_FRAMES, 97, 40)]


@pytest.fixture(scope="module")
def fulls(decoder, streams) -> list[np.ndarray]:
    with torch.inference_mode():
        return [decoder(torch.from_numpy(s).T[None])[0, 0].numpy() for s in streams]


@pytest.fixture(scope="module")
def stateless(decoder) -> Code2WavEngine:
    return Code2WavEngine(decoder, Code2WavEngineConfig(stateful=False))


def stateful_engine(decoder, slots: int = 8, **kwargs) -> Code2WavEngine:
    return Code2WavEngine(decoder, Code2WavEngineConfig(stateful=True, state_slots=slots, **kwargs))


def chunks_of(frames: np.ndarray, rid: str, schedule: ChunkSchedule = FIRST_1,
              ref: np.ndarray | None = None) -> list[CodecChunk]:
    chunker = StreamChunker(schedule, rid, ref_codes=ref)
    return [*chunker.push(frames), chunker.flush(FinishReason.EOS)]


def decode_interleaved(engine: Code2WavEngine, per_stream: list[list[CodecChunk]], all_from: int) -> list[np.ndarray]:
    """Each call takes the next chunk of every other stream (all of them from call `all_from` on): rows of
    different lengths, positions and slots in one batch. -> each stream's concatenated samples."""
    outs: list[list[np.ndarray]] = [[] for _ in per_stream]
    step = 0
    while any(per_stream):
        batch = [(i, q.pop(0)) for i, q in enumerate(per_stream) if q and ((i + step) % 2 == 0 or step > all_from)]
        step += 1
        for (i, _), pcm in zip(batch, engine.decode([c for _, c in batch]), strict=True):
            outs[i].append(pcm)
    return [np.concatenate(o) for o in outs]


def test_stream_equals_whole_decode_beyond_the_receptive_field(decoder, streams, fulls, stateless):
    engine = stateful_engine(decoder)
    chunks = chunks_of(streams[0], "a")
    out = np.concatenate([engine.decode([c])[0] for c in chunks])
    assert out.shape == fulls[0].shape
    assert np.abs(out - fulls[0]).max() < TOL
    # the stateless decode of the same chunks is off by far more (context shorter than the receptive field)
    stateless_out = np.concatenate(stateless.decode(chunks))
    assert np.abs(stateless_out - fulls[0]).max() > 10 * TOL
    s = engine.stats()
    assert (s.fresh, s.continued, s.evicted) == (1, sum(c.num_new > 0 for c in chunks[1:]), 0)
    assert s.decoded_frames == s.new_frames == STREAM_FRAMES
    assert len(engine._slots) == 0  # the final chunk freed the slot


def test_interleaved_streams_batched_with_padding_are_each_exact(decoder, streams, fulls):
    engine = stateful_engine(decoder)
    per_stream = [chunks_of(s, f"r{i}", ChunkSchedule(first_chunk_frames=2 + i)) for i, s in enumerate(streams)]
    outs = decode_interleaved(engine, per_stream, all_from=6)
    for i, full in enumerate(fulls):
        assert np.abs(outs[i] - full).max() < TOL, f"stream {i}"
    assert engine.stats().fresh == len(streams)


def test_several_chunks_of_one_stream_in_one_call_run_in_order(decoder, streams, fulls):
    engine = stateful_engine(decoder)
    chunks = chunks_of(streams[1], "a") + chunks_of(streams[2], "b")
    out = engine.decode(chunks)  # one call: every chunk of both streams
    a = len(chunks_of(streams[1], "a"))
    assert np.abs(np.concatenate(out[:a]) - fulls[1]).max() < TOL
    assert np.abs(np.concatenate(out[a:]) - fulls[2]).max() < TOL
    assert engine.stats().forwards >= a - 1  # one wave per chunk of the longer stream


def test_misses_decode_like_the_stateless_engine(decoder, streams, stateless):
    engine = stateful_engine(decoder)
    chunks = chunks_of(streams[0], "a")
    first = engine.decode(chunks[:2])
    # chunk 2 went elsewhere: chunk 3 starts over from its left context, then the stream continues
    gap = engine.decode([chunks[3]])[0]
    np.testing.assert_allclose(gap, stateless.decode([chunks[3]])[0], atol=TOL)
    late = engine.decode([chunks[2]])[0]  # arrives after its successor: decoded aside, state untouched
    np.testing.assert_allclose(late, stateless.decode([chunks[2]])[0], atol=TOL)
    s = engine.stats()
    assert (s.fresh, s.continued) == (3, 1)
    after_gap = engine.decode([chunks[4]])[0]  # continues from chunk 3's state
    assert engine.stats().continued == 2
    assert len(first) == 2 and after_gap.shape == (chunks[4].num_new * SPF,)


def test_eviction_bounds_the_slots_and_falls_back(decoder, streams, stateless):
    engine = stateful_engine(decoder, slots=1)
    a, b = chunks_of(streams[1], "a"), chunks_of(streams[2], "b")
    for ca, cb in zip(a[:4], b[:4], strict=True):  # alternate: each stream takes the only slot from the other
        for c in (ca, cb):
            np.testing.assert_allclose(engine.decode([c])[0], stateless.decode([c])[0], atol=TOL)
    s = engine.stats()
    assert s.continued == 0 and s.fresh == 8 and s.evicted == 7
    assert len(engine._slots) == 1


def test_icl_reference_as_context_of_the_first_chunk(decoder, streams):
    ref, gen = streams[2][:20], streams[1]  # within the default 25 frames of reference context
    engine = stateful_engine(decoder)
    out = np.concatenate(engine.decode(chunks_of(gen, "icl", ref=ref)))
    with torch.inference_mode():  # the official decode: cat(ref, generated), reference samples cut
        whole = decoder(torch.from_numpy(np.concatenate([ref, gen])).T[None])[0, 0].numpy()[20 * SPF:]
    assert np.abs(out - whole).max() < TOL


def test_a_failed_forward_starts_the_streams_over(decoder, streams, stateless, monkeypatch):
    engine = stateful_engine(decoder)
    chunks = chunks_of(streams[0], "a")
    engine.decode(chunks[:2])
    real_run = engine._run

    def failing(*args):
        raise RuntimeError("device error")

    monkeypatch.setattr(engine, "_run", failing)
    with pytest.raises(RuntimeError):
        engine.decode([chunks[2]])
    monkeypatch.setattr(engine, "_run", real_run)
    assert len(engine._slots) == 0
    np.testing.assert_allclose(engine.decode([chunks[3]])[0], stateless.decode([chunks[3]])[0], atol=TOL)


def test_a_poisoned_slot_never_reaches_the_next_stream(decoder, streams, stateless):
    """A slot whose state went non-finite (say a bf16 overflow) is read as zeros by the next fresh stream."""
    engine = stateful_engine(decoder, slots=1)
    chunks = chunks_of(streams[2], "b")
    engine.decode(chunks_of(streams[1], "a")[:2])  # stream a holds slot 0, then leaves without a final chunk
    for buf in [*engine._states.convs.values(), engine._states.keys, engine._states.values]:
        buf.fill_(float("nan"))
    out = engine.decode([chunks[0]])[0]  # b evicts a and starts fresh in slot 0
    np.testing.assert_allclose(out, stateless.decode([chunks[0]])[0], atol=TOL)
    assert engine.stats().evicted == 1


def test_the_compiled_windowed_transformer_continues_streams_exactly(decoder, streams, fulls):
    """The stateful pre-transformer as the compiled engine runs it (`compiled.stateful_transformer`: one fused
    function, the windows read and written around it), through CPU Inductor: two streams in chunks of 8 frames,
    the second shorter (padded rows), equal the whole decode."""
    from stages.code2wav import compiled

    states = DecoderStates(decoder, 2)
    stateful = StatefulDecoder(decoder, states, compiled.stateful_transformer())
    a, b = streams[2], streams[2][:27]
    outs: list[list[np.ndarray]] = [[], []]
    with torch.inference_mode():
        for start in range(0, len(a), 8):
            codes = np.zeros((2, 16, 8), dtype=np.int64)
            lengths = [len(s[start:start + 8]) for s in (a, b)]
            for r, s in enumerate((a, b)):
                codes[r, :, :lengths[r]] = s[start:start + 8].T
            rows = [i for i in range(2) if lengths[i]]
            wav = stateful(torch.from_numpy(codes[rows]), torch.tensor(rows), torch.tensor([start == 0] * len(rows)),
                           torch.tensor([lengths[r] for r in rows]))
            for i, r in enumerate(rows):
                outs[r].append(wav[i, 0, :lengths[r] * SPF].numpy())
    assert np.abs(np.concatenate(outs[0]) - fulls[2]).max() < TOL
    with torch.inference_mode():
        whole_b = decoder(torch.from_numpy(b).T[None])[0, 0].numpy()
    assert np.abs(np.concatenate(outs[1]) - whole_b).max() < TOL
    assert int(states.history[1]) == min(27, states.window)


def test_batches_of_the_models_own_sizes_share_the_compiled_transformers_trace(decoder):
    """The compiled windowed transformer traced without duck shaping (stages/code2wav/compiled.py): a batch of 8 or
    16 (the tiny decoder's RoPE frequencies and head dim, fixed sizes of the function's inputs) is no variant of
    its own; with duck shaping each was specialized and traced again (2 traces here, more for the full model's
    serving buckets, each compiled on a first start and loaded on every start)."""
    from torch._dynamo.utils import counters

    from stages.code2wav import compiled

    assert decoder.cfg.head_dim == 16 and decoder.cfg.head_dim // 2 == 8
    torch._dynamo.reset()
    traced = counters["stats"]["unique_graphs"]
    stateful = StatefulDecoder(decoder, DecoderStates(decoder, 16), compiled.stateful_transformer())
    with torch.no_grad():
        for batch in (3, 8, 16):
            stateful(torch.randint(0, 64, (batch, 16, 3)), torch.arange(batch), torch.ones(batch, dtype=torch.bool),
                     torch.full((batch,), 3))
    assert counters["stats"]["unique_graphs"] - traced == 1


def test_a_compiled_engine_pads_sizes_of_one_and_traces_once(decoder, streams, fulls, monkeypatch):
    """torch.compile specializes sizes of 1, so a compiled engine decodes a lone chunk and one-frame chunks padded
    to 2 (rows and frames): a stream decoded one chunk per call from a one-frame first chunk is exact and every
    forward shares one trace of the compiled transformer (it took four: batch 1 or more, length 1 or more).
    On CPU `compiled.enable` compiles nothing (CUDA only): patched to report compiled, the engine compiles its
    stateful transformer through CPU Inductor."""
    from torch._dynamo.utils import counters

    from stages.code2wav import compiled

    monkeypatch.setattr(compiled, "enable", lambda _decoder: True)
    torch._dynamo.reset()
    traced = counters["stats"]["unique_graphs"]
    engine = stateful_engine(decoder, compile=True)
    assert engine.compiled and engine.min_size == 2 and min(engine.batch_buckets + engine.length_buckets) == 2
    chunks = chunks_of(streams[2], "a")
    assert chunks[0].num_new == 1
    out = np.concatenate([engine.decode([c])[0] for c in chunks])
    assert np.abs(out - fulls[2]).max() < TOL
    assert counters["stats"]["unique_graphs"] - traced == 1
    s = engine.stats()
    assert s.forwards == s.batches == len(chunks) and s.padded_frames >= 2 * s.decoded_frames  # every row paired


def test_the_first_chunk_decoder_and_code2wav_keep_their_compiled_work_apart(decoder, monkeypatch, tmp_path):
    """The Talker's first-chunk decoder and the Code2Wav replica compile the same functions for different shapes:
    one compile cache file between them made each start replace the other's Dynamo work and trace again (an H100,
    2026-11-25: Code2Wav 2 traces and the first-chunk decoder 1 on every start from the cache). The same engine
    config finds its own file again (a restart)."""
    from deployments.talker.first_chunk_decoder import engine_config
    from stages.code2wav import compiled

    monkeypatch.setattr(compiled, "enable", lambda _decoder: True)  # CPU: compiled.enable compiles nothing
    first_chunks, _, _ = engine_config(FIRST_1, compile=True, compile_cache_dir=str(tmp_path))
    serving = Code2WavEngineConfig(max_batch_size=64, stateful=True, compile=True, compile_cache_dir=str(tmp_path))
    stateless = Code2WavEngineConfig(stateful=False, max_batch_size=64, compile=True,  # shapes alone
                                     compile_cache_dir=str(tmp_path))
    configs = (first_chunks, serving, serving, stateless)
    paths = [Code2WavEngine(decoder, config).compile_cache().path for config in configs]
    assert len({paths[0], paths[1], paths[3]}) == 3 and paths[1] == paths[2] and paths[0].parent == tmp_path


def test_state_shapes_and_graph_lengths(decoder):
    cfg = decoder.cfg
    states = DecoderStates(decoder, 3)
    convs = carried_convs(decoder)
    assert convs["pre_conv"] == (cfg.codebook_dim, 2)
    assert convs["decoder.0.2"][1] == 6 * 9  # k7, dilation 9
    assert states.keys.shape == (cfg.num_hidden_layers, 4, cfg.num_key_value_heads, cfg.sliding_window - 1,
                                 cfg.head_dim)
    assert states.bytes_per_slot > 0
    schedule = ChunkSchedule(first_chunk_frames=1)
    assert schedule.graph_lengths(stateful=True) == [1, 2, 4, 8, 16, 25, 50]
    assert schedule.graph_lengths(stateful=False) == schedule.decode_lengths()
    assert schedule.chunk_sizes() == [1, 2, 4, 8, 16, 25]
    assert ChunkSchedule(ramp=(4, 4, 8)).chunk_sizes() == [2, 4, 8, 25]
    with pytest.raises(ValueError):
        Code2WavEngineConfig(stateful=True, state_slots=0)


# ---- StreamSlots (torch-free) ---------------------------------------------------------------------------
def _chunk(rid: str, seq: int, new: int = 2, ctx: int = 0, final: bool = False) -> CodecChunk:
    return CodecChunk(rid, seq, np.zeros((ctx + new, 16), dtype=np.int64), ctx, final=final)


def test_slots_continue_only_the_next_chunk():
    slots = StreamSlots(2)
    [r0] = slots.assign([_chunk("a", 0)])
    assert (r0.slot, r0.fresh, r0.wave) == (0, True, 0)
    r1, r2, r3 = slots.assign([_chunk("a", 1, ctx=2), _chunk("a", 2, ctx=2), _chunk("b", 0)])
    assert (r1.fresh, r1.wave, r1.start(_chunk("a", 1, ctx=2))) == (False, 0, 2)
    assert (r2.fresh, r2.wave, r2.slot) == (False, 1, 0)
    assert (r3.slot, r3.fresh) == (1, True)
    [late] = slots.assign([_chunk("a", 1, ctx=2)])
    assert (late.slot, late.fresh, late.offset(_chunk("a", 1, ctx=2))) == (slots.scratch, True, 2)
    [skip] = slots.assign([_chunk("a", 5)])
    assert (skip.slot, skip.fresh) == (0, True)
    [cont] = slots.assign([_chunk("a", 6)])
    assert not cont.fresh


def test_slots_evict_least_recent_never_one_in_use_and_free_on_final():
    slots = StreamSlots(2)
    slots.assign([_chunk("a", 0), _chunk("b", 0)])
    slots.assign([_chunk("a", 1)])  # b is now least recently used
    [c] = slots.assign([_chunk("c", 0)])
    assert c.slot == 1 and slots.counts["evicted"] == 1
    # both slots serve this call: the third new stream decodes on scratch without keeping state
    rows = slots.assign([_chunk("a", 2), _chunk("c", 1), _chunk("d", 0)])
    assert [r.slot for r in rows] == [0, 1, slots.scratch]
    assert [r.fresh for r in rows] == [False, False, True]
    empty_final = _chunk("a", 3, new=0, final=True)
    assert slots.assign([empty_final]) == [None]
    slots.release([empty_final])
    assert len(slots) == 1
    [d] = slots.assign([_chunk("d", 1)])
    assert d.slot == 0 and d.fresh and slots.counts["evicted"] == 1


# ---- CUDA graphs and fused kernels (GPU only) -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("fast_kernels", "compile"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_stateful_streams_match_the_whole_decode(decoder, streams, fulls, dtype, fast_kernels, compile,
                                                         monkeypatch):
    """Three streams interleaved through graphed forwards (padding rows and padded lengths included) against
    the whole fp32 CPU decode: fp32 within 1e-4, bf16 within the serving dtype's own rounding (SNR > 30 dB)."""
    import copy

    from stages.code2wav import fast

    monkeypatch.setattr(fast, "UPSAMPLE_GEMM_MIN_CHANNELS", 32)  # its blocks 0-1 as GEMMs, 2-3 as cuDNN's
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    schedule = ChunkSchedule(first_chunk_frames=1)
    cfg = Code2WavEngineConfig.for_schedule(schedule, max_batch_size=4, batch_buckets=(1, 2, 4),
                                            fast_kernels=fast_kernels, stateful=True, state_slots=4, compile=compile)
    engine = Code2WavEngine(copy.deepcopy(decoder).to("cuda", dtype), cfg)
    assert engine.fast_kernels == fast_kernels and engine.compiled == compile
    engine.warmup(log=print)
    assert engine.stats().graphs == len(engine.graph_shapes()) > 0
    outs = decode_interleaved(engine, [chunks_of(s, f"r{i}", schedule) for i, s in enumerate(streams)], all_from=4)
    for i, full in enumerate(fulls):
        out = outs[i]
        diff = float(np.abs(out - full).max())
        noise = float(np.sum((out.astype(np.float64) - full) ** 2))
        snr = 10 * np.log10(float(np.sum(full.astype(np.float64) ** 2)) / max(noise, 1e-30))
        print(f"stateful {dtype} fast={fast_kernels} stream {i}: max diff {diff:.2e}, SNR {snr:.1f} dB")
        assert diff <= (1e-4 if dtype == torch.float32 else 5e-2), diff
        assert snr > (80 if dtype == torch.float32 else 30)
    s = engine.stats()
    assert s.graph_forwards == s.forwards and s.continued > 0 and s.fresh == len(streams)


@pytest.mark.slow  # Triton's interpreter in its venv
def test_the_state_carry_kernel_equals_the_pytorch_path():
    """stages/code2wav/state_carry.py's CUDA kernel under Triton's interpreter (fp32 and fp16 on CPU) against its
    PyTorch path: the conv inputs' state columns and the slots' saved states equal exactly for 1-54 state columns,
    channels off the kernel's block, time- and channel-major inputs, rows with fewer new samples than state
    columns (part of the old state carried on), fresh rows (a NaN in a fresh row's slot never reaches its input)
    and padding rows sharing the scratch slot."""
    from tests.triton_interpreter import run_interpreted

    result = run_interpreted("state_carry.py")
    assert len(result) == 12
    for name, r in result.items():
        assert r == {"padded_equal": True, "state_equal": True, "fresh_row_finite": True, "state_changed": True}, name
