"""The deployment classes' servers without Serve (`sync_init` + `start`) on the real engines and a tiny checkpoint,
one of each per test module that asks (test_servers.py, test_first_chunk_decoder_server.py), on that module's
event loop."""

from __future__ import annotations

import asyncio

import pytest

from deployments.code2wav.server import Code2WavServer
from deployments.config import CheckpointSource, Code2WavDeploymentConfig, TalkerDeploymentConfig
from tests.deployments.server_requests import STREAMING


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()

    async def cancelled() -> None:  # gathered on this loop (outside it, gather would take another)
        await asyncio.gather(*pending, return_exceptions=True)

    loop.run_until_complete(cancelled())
    loop.close()


def _talker_server(loop, checkpoint, first_chunk_decode_max_running: int):
    """A started Talker server of 4 rows and 64 positions that decodes first chunks itself while at most
    `first_chunk_decode_max_running` requests run (0: never)."""
    from deployments.talker.server import TalkerServer

    config = TalkerDeploymentConfig(name="cv", model=str(checkpoint), device="cpu", cpu_threads=1,
                                    engine_kwargs={"max_num_seqs": 4, "max_seq_len": 64},
                                    first_chunk_decode_max_running=first_chunk_decode_max_running)
    server = TalkerServer.sync_init(config, STREAMING)
    loop.run_until_complete(server.start())
    return server


@pytest.fixture(scope="module")
def talker(loop, tiny_custom_voice):
    """Every chunk leaves undecoded (Code2Wav decodes them): no first-chunk decoder."""
    server = _talker_server(loop, tiny_custom_voice, 0)
    yield server
    server.__del__()


@pytest.fixture(scope="module")
def code2wav(loop, tiny_custom_voice):
    # stateless (every chunk over its left context: the exact comparisons below) and no batch fill (the fill tests
    # set their own waits); the serving defaults are stateful with batch fill (tests/serve runs them)
    server = Code2WavServer.sync_init(Code2WavDeploymentConfig(device="cpu", max_batch_size=8, batch_fill_chunks=0,
                                                               engine_kwargs={"stateful": False}),
                                      CheckpointSource(model=str(tiny_custom_voice)), STREAMING)
    loop.run_until_complete(server.start())
    yield server


@pytest.fixture(scope="module")
def decoding_talker(loop, tiny_custom_voice):
    """A Talker that decodes first chunks itself while at most one request runs."""
    server = _talker_server(loop, tiny_custom_voice, 1)
    assert loop.run_until_complete(server.first_chunk_decoder_built()) is True  # built beside the ready replica
    yield server
    server.__del__()
