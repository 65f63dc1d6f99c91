"""Stream affinity against real Serve: two stateful Code2Wav replicas behind the project's request router.

Each stream's chunks after its first must reach the replica holding its state (decoded from it: `continued`),
so the two replicas together decode one chunk per stream fresh. Serve's own router sends each call by load, and
the named calls land on the other replica about half of the time (the check fails without
`StreamAffinityRouter`: `named_elsewhere` > 0, fresh > streams).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from deployments.config import CheckpointSource, Code2WavDeploymentConfig, StreamingConfig
from deployments.ingress.decode_batcher import DecodeBatcher
from deployments.ingress.placement import StreamPlacement
from stages.contract import FinishReason
from tests.serve.conftest import ZERO_CPU

pytestmark = pytest.mark.serve

APP = "affinity-test"
STREAMS, FRAMES = 6, 40


@pytest.fixture(scope="module")
def code2wav(ray_cluster, tiny_custom_voice):
    from ray import serve

    from deployments.builder import build_code2wav_deployment

    streaming = StreamingConfig(first_chunk_frames=2, steady_chunk_frames=8, left_context_frames=4)
    config = Code2WavDeploymentConfig(device="cpu", cpu_threads=1, max_batch_size=8,
                                      engine_kwargs={"stateful": True, "state_slots": 16},
                                      deployment_config={"num_replicas": 2, **ZERO_CPU})
    serve.run(build_code2wav_deployment(config, CheckpointSource(model=str(tiny_custom_voice)), streaming,
                                        stream_affinity=True), name=APP, route_prefix=None)
    yield serve.get_deployment_handle("Code2Wav", app_name=APP), streaming
    serve.delete(APP, _blocking=False)  # no later test deploys this name: its replicas stop meanwhile


def _stats_of_both(handle) -> dict[str, dict]:
    """engine_stats of each of the two replicas (bench.replica_stats asks until both answered)."""
    from bench.replica_stats import every_replica

    seen = asyncio.run(every_replica(handle, 2))
    assert len(seen) == 2, seen.keys()
    return seen


def test_each_streams_chunks_continue_on_the_replica_that_took_its_first(code2wav):
    from stages.chunking import StreamChunker

    handle, streaming = code2wav
    before = _stats_of_both(handle)
    rng = np.random.default_rng(5)
    streams = {}
    for i in range(STREAMS):
        chunker = StreamChunker(streaming.schedule(), f"s{i}")
        streams[f"s{i}"] = [*chunker.push(rng.integers(0, 2048, (FRAMES, 16), dtype=np.int64)),
                            chunker.flush(FinishReason.LENGTH)]
    chunks = sum(len(c) for c in streams.values())
    assert chunks >= 4 * STREAMS

    async def decode_all():
        # one call at a time: a stream's chunks reach its replica in order (two calls of one ingress may overtake
        # each other on the way, and a chunk that arrives after its successor decodes fresh, by design)
        batcher = DecodeBatcher(handle, max_chunks=8, max_calls_in_flight=1, placement=StreamPlacement())
        try:  # every chunk submitted at once: each stream's later chunks wait for its first's answer
            return await asyncio.gather(*(batcher.submit(c, stream=rid) for rid, cs in streams.items() for c in cs))
        finally:
            await batcher.close()

    answers = asyncio.run(decode_all())
    assert [(a.request_id, a.seq) for a in answers] == [(c.request_id, c.seq) for cs in streams.values() for c in cs]
    for rid in streams:  # one replica answered all of a stream's chunks
        assert len({a.replica for a in answers if a.request_id == rid}) == 1
    after = _stats_of_both(handle)
    assert set(after) == set(before)

    def total(key: str) -> int:
        return sum(after[r][key] - before[r][key] for r in after)

    assert total("named_elsewhere") == 0
    assert total("fresh") == STREAMS  # each stream's first chunk
    assert total("continued") == chunks - STREAMS
    assert total("named_here") == chunks - STREAMS
