"""The Talker's first-chunk decoder in its server (`sync_init` + `start`, real engines, a tiny checkpoint): chunks
it decodes continue exactly into Code2Wav's, its pending decodes count as running, it batches, compiles where the
engine does, is built after the replica serves, and leaves first chunks to Code2Wav under load (the fixtures:
tests/deployments/conftest.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

import numpy as np

from deployments.config import TalkerDeploymentConfig
from stages.contract import SAMPLES_PER_FRAME
from tests.deployments.server_requests import STREAMING, collect, request_for


def test_chunks_the_talker_decodes_continue_exactly_into_code2wavs(loop, decoding_talker, talker, code2wav):
    """Talker-decoded chunks 0 and 1 + Code2Wav's decode of the rest == Code2Wav decoding the whole stream."""
    from deployments.ingress.decode_batcher import DecodeBatcher

    before = decoding_talker._first_decoder.decoded
    stats_before = loop.run_until_complete(decoding_talker.engine_stats())["first_chunk_decoder"]
    chunks = loop.run_until_complete(collect(decoding_talker.generate(request_for(decoding_talker, 13, rid="fc"))))
    plain = loop.run_until_complete(collect(talker.generate(request_for(talker, 13, rid="fc-plain"))))
    assert all(c.pcm is not None and c.pcm.dtype == np.int16 for c in chunks[:2])
    assert all(c.pcm is None for c in chunks[2:]) and all(c.pcm is None for c in plain)
    for ours, theirs in zip(chunks, plain, strict=True):  # the same codes (same seed): only the first has PCM
        np.testing.assert_array_equal(ours.codes, theirs.codes)
    assert decoding_talker._first_decoder.decoded == before + 2
    # what the bench's replica stats read: the Talker's own decodes, beside its engine's counters
    stats_after = loop.run_until_complete(decoding_talker.engine_stats())["first_chunk_decoder"]
    assert stats_after["chunks"] == stats_before["chunks"] + 2 and stats_after["forwards"] > stats_before["forwards"]
    assert "first_chunk_decoder" not in loop.run_until_complete(talker.engine_stats())

    async def through_code2wav(stream):
        # the ingress's path: a chunk with PCM is answered at once, the others decoded by Code2Wav
        class Handle:
            def __init__(self):
                self.decode_many = self
                self.sent = []

            def remote(self, batch):
                self.sent += batch
                return code2wav.decode_many(batch)

        handle = Handle()
        batcher = DecodeBatcher(handle, max_chunks=8, max_calls_in_flight=1)
        answers = [await batcher.submit(c) for c in stream]
        await batcher.close()
        return answers, handle.sent

    ours, sent = loop.run_until_complete(through_code2wav(chunks))
    whole, _ = loop.run_until_complete(through_code2wav(plain))
    assert [c.seq for c in sent] == [c.seq for c in chunks[2:]]  # chunks 0 and 1 never went to Code2Wav
    # fp32 on CPU: chunks 0 and 1 decoded from zero state over the whole stream before them are the whole
    # decode's; chunk 2 then decodes over its left context (Code2Wav's `fresh` path), which continues them
    # (+-1 LSB from batch composition)
    got, want = np.concatenate([a.pcm for a in ours]), np.concatenate([a.pcm for a in whole])
    assert got.size == want.size == 13 * SAMPLES_PER_FRAME
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def test_pending_first_chunk_decodes_count_as_running_requests_when_asked(loop, decoding_talker, monkeypatch):
    """`first_chunk_decode_count_pending`: a first chunk is taken while running requests + the decodes pending in
    the Talker stay within the gate (a burst's first chunks fill it, arrivals one by one do not); off, pending
    decodes do not count. A stream's chunk 1 follows its Talker-decoded chunk 0 whatever is pending."""
    import threading

    decoder = decoding_talker._first_decoder  # gate: max_running 1
    chunks = loop.run_until_complete(collect(decoding_talker.generate(request_for(decoding_talker, 5, rid="cp"))))
    assert chunks[0].pcm is not None  # (ran alone: decoded here)
    first = dataclasses.replace(chunks[0], pcm=None, request_id="cp-again")
    started, release = threading.Event(), threading.Event()
    real_decode = decoder._engine.decode

    def held_decode(work, **kw):  # the decode stays pending until the test releases it
        started.set()
        release.wait()
        return real_decode(work, **kw)

    monkeypatch.setattr(decoder._engine, "decode", held_decode)

    async def scenario():
        pending = asyncio.ensure_future(decoder.decode(first))
        await asyncio.to_thread(started.wait)
        assert decoder.pending == 1
        monkeypatch.setattr(decoder, "count_pending", False)
        assert decoder.takes(first, 1, None)  # 1 running <= 1: pending decodes do not count
        monkeypatch.setattr(decoder, "count_pending", True)
        assert not decoder.takes(first, 1, None)  # 1 running + 1 pending > 1
        assert decoder.takes(first, 0, None)  # 0 + 1 <= 1
        assert decoder.takes(chunks[1], 1, chunks[0])  # chunk 1 of a stream whose chunk 0 was decoded here
        release.set()
        await pending
        return decoder.pending, decoder.takes(first, 1, None)

    assert loop.run_until_complete(scenario()) == (0, True)


def test_first_chunk_decodes_waiting_together_split_into_forwards_of_max_batch(loop, decoding_talker):
    """`first_chunk_decode_max_batch`: three first chunks waiting together with a batch of 2 take two forwards, each
    chunk's PCM the same as decoded alone (+-1 LSB from batch composition)."""
    from deployments.talker.first_chunk_decoder import FirstChunkDecoder

    chunks = loop.run_until_complete(collect(decoding_talker.generate(request_for(decoding_talker, 5, rid="mb"))))
    first = dataclasses.replace(chunks[0], pcm=None)
    decoder = FirstChunkDecoder(decoding_talker._model.decoder, decoding_talker._schedule, max_running=4, max_batch=2)
    assert decoder._engine.config.batch_buckets == (1, 2)
    engine, forwards = decoder._engine, []
    real_decode = engine.decode
    engine.decode = lambda work, **kw: forwards.append(len(work)) or real_decode(work, **kw)

    async def three():
        return await asyncio.gather(*(decoder.decode(dataclasses.replace(first, request_id=f"mb-{i}")) for i in range(3)))

    try:
        pcm = loop.run_until_complete(three())
    finally:
        decoder.shutdown()
    assert sorted(forwards) == [1, 2]
    for p in pcm:
        assert p.shape == chunks[0].pcm.shape
        assert np.abs(p.astype(np.int32) - chunks[0].pcm.astype(np.int32)).max() <= 1


def test_the_first_chunk_decoder_compiles_where_the_talkers_engine_does(loop, tiny_custom_voice, tmp_path):
    """`first_chunk_decode_compile` (on by default) with `engine_kwargs.compile`: the Talker's first-chunk decoder is
    built compiled too, with the engine's compile cache directory (CUDA only: on CPU both stay eager, so the decoder
    reports not compiled); with the option off it is not."""
    from deployments.talker.server import TalkerServer

    config = TalkerDeploymentConfig(name="cv", model=str(tiny_custom_voice), device="cpu", cpu_threads=1, warmup=False,
                                    engine_kwargs={"max_num_seqs": 2, "max_seq_len": 64, "compile": True,
                                                   "compile_cache_dir": str(tmp_path)},
                                    first_chunk_decode_max_running=1)
    assert config.first_chunk_decode_compile is True
    server = TalkerServer.sync_init(config, STREAMING)
    loop.run_until_complete(server.start())
    try:
        assert loop.run_until_complete(server.first_chunk_decoder_built()) is True
        engine = server._first_decoder._engine
        assert engine.config.compile is True and engine.config.compile_cache_dir == str(tmp_path)
        assert engine.compiled is False and not list(tmp_path.iterdir())
    finally:
        server.__del__()
    off = TalkerServer.sync_init(TalkerDeploymentConfig(**{**config.model_dump(), "first_chunk_decode_compile": False}),
                                 STREAMING)
    loop.run_until_complete(off.start())
    try:
        assert loop.run_until_complete(off.first_chunk_decoder_built()) is True
        assert off._first_decoder._engine.config.compile is False
    finally:
        off.__del__()


def test_the_talker_serves_before_its_first_chunk_decoder_is_built(loop, tiny_custom_voice, monkeypatch):
    """The first-chunk decoder is built beside the ready replica: until then every chunk leaves undecoded (Code2Wav
    decodes it), after it the first chunks are decoded here; a build that fails leaves the replica serving."""
    import threading

    from deployments.talker.first_chunk_decoder import FirstChunkDecoder
    from deployments.talker.server import TalkerServer

    release, building = threading.Event(), threading.Event()
    real_start = FirstChunkDecoder._start

    def held_start(self, then):
        building.set()
        assert release.wait(60), "the test never released the build"
        real_start(self, then)

    monkeypatch.setattr(FirstChunkDecoder, "_start", held_start)
    config = TalkerDeploymentConfig(name="cv", model=str(tiny_custom_voice), device="cpu", cpu_threads=1, warmup=False,
                                    engine_kwargs={"max_num_seqs": 2, "max_seq_len": 64},
                                    first_chunk_decode_max_running=1)
    server = TalkerServer.sync_init(config, STREAMING)
    frozen = gc.get_freeze_count()
    try:
        loop.run_until_complete(server.start())
        assert loop.run_until_complete(server.ready()) is True
        assert loop.run_until_complete(asyncio.to_thread(building.wait, 60))  # the build has begun and waits
        early = loop.run_until_complete(collect(server.generate(request_for(server, 5, rid="early"))))
        assert len(early) >= 2 and all(c.pcm is None for c in early)  # all to Code2Wav
        release.set()
        assert loop.run_until_complete(server.first_chunk_decoder_built()) is True
        # what the build left is frozen, as Serve freezes what __init__ left: full collections do not walk it; done
        # before the decoder says it is ready (the collection stops every thread once)
        assert gc.get_freeze_count() > frozen
        later = loop.run_until_complete(collect(server.generate(request_for(server, 5, rid="later"))))
        assert later[0].pcm is not None and later[0].pcm.size == later[0].num_new * SAMPLES_PER_FRAME
    finally:
        release.set()
        server.__del__()
        gc.unfreeze()  # the test process's objects: collectable again

    def failing_start(self, then):
        raise RuntimeError("no room for the decoder's graphs")

    collections = []
    monkeypatch.setattr(FirstChunkDecoder, "_start", failing_start)
    monkeypatch.setattr("deployments.talker.server._collect_and_freeze", lambda: collections.append(1))
    failed = TalkerServer.sync_init(config, STREAMING)
    try:
        loop.run_until_complete(failed.start())
        assert loop.run_until_complete(failed.first_chunk_decoder_built()) is False
        assert collections == [1]  # what a failed build left is collected and frozen too
        chunks = loop.run_until_complete(collect(failed.generate(request_for(failed, 5, rid="after-failure"))))
        assert chunks[-1].final and all(c.pcm is None for c in chunks)
    finally:
        failed.__del__()


def test_a_loaded_talker_leaves_first_chunks_to_code2wav(loop, decoding_talker):
    async def two_at_once():
        streams = [decoding_talker.generate(request_for(decoding_talker, 20, rid=f"busy-{i}", seed=i)) for i in range(2)]
        return await asyncio.gather(*(collect(s) for s in streams))

    before = decoding_talker._first_decoder.decoded
    a, b = loop.run_until_complete(two_at_once())
    decoded = decoding_talker._first_decoder.decoded - before
    # two requests run together: the first to be cut may still see one running (itself), the other sees two
    # and leaves all its chunks to Code2Wav (its chunk 1 follows its chunk 0)
    assert decoded <= 2
    assert all(c.pcm is None for c in a) or all(c.pcm is None for c in b)
