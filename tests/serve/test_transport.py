"""deployments/transport.py against real Serve: both stage transports carry a stream into a second deployment, and
the whole app serves speech over the "object_ref" transport (the session app runs the default, "grpc").

The "object_ref" transport relies on a Serve developer API (`_by_reference`); this test is where a Ray upgrade that
changes it fails first.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.transport import resolve, stage_handle
from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import ZERO_CPU, pcm_of, speech, wait_for

pytestmark = pytest.mark.serve

APP = "transport-test"


@pytest.fixture(scope="module")
def handles(ray_cluster):
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Producer:
        async def numbers(self, n: int):
            for i in range(n):
                yield {"seq": i, "payload": bytes([i]) * 2000}

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Consumer:
        async def total(self, items: list) -> list[int]:
            """Like Code2Wav.decode_many: each item is a value or a ref to one."""
            values = [await resolve(item) for item in items]
            return [v["seq"] + len(v["payload"]) for v in values]

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, producer, consumer):
            self._producer, self._consumer = producer, consumer

        async def run(self, transport: str, n: int) -> tuple[list[str], list[int]]:
            """In a replica, as the ingress does: the producer's stream forwarded to the consumer."""
            generator = stage_handle(self._producer, transport).options(stream=True).numbers.remote(n)
            items = [item async for item in generator]
            kinds = [type(item).__name__ for item in items]
            return kinds, await stage_handle(self._consumer, transport).total.remote(items)

    serve.run(Front.bind(Producer.bind(), Consumer.bind()), name=APP, route_prefix=None)
    yield serve.get_app_handle(APP)
    serve.delete(APP, _blocking=False)  # no later test deploys this name: its replicas stop meanwhile


@pytest.mark.parametrize("transport", ["grpc", "object_ref"])
def test_a_stream_reaches_the_next_stage(handles, transport):
    kinds, totals = handles.run.remote(transport, 5).result(timeout_s=60)
    assert kinds == ["dict"] * 5
    assert totals == [i + 2000 for i in range(5)]


def test_the_grpc_transport_carries_values_from_a_driver_too(handles):
    """The handle options themselves (no replica around them): what `stage_handle` sets is accepted by Serve."""
    from ray import serve

    async def run():
        producer = serve.get_deployment_handle("Producer", app_name=APP)
        generator = stage_handle(producer, "grpc").options(stream=True).numbers.remote(3)
        return [item["seq"] async for item in generator]

    assert asyncio.run(run()) == [0, 1, 2]


OBJREF = "objref"


@pytest.fixture(scope="module")
def objref_app(ray_cluster, tiny_custom_voice, tmp_path_factory):
    """The app at /objref with `ingress.stage_transport: object_ref`: the fake engine behind the Talker, a stateful
    Code2Wav (the defaults), one ingress replica."""
    import httpx
    from ray import serve

    from deployments.builder import build_app

    args = {
        "models": [{"name": "fake", "model": str(tiny_custom_voice), "device": "cpu", "cpu_threads": 1,
                    "engine_cls": "tests.fake_engine:FakeTalkerEngine",
                    "engine_kwargs": {"max_num_seqs": 2, "max_seq_len": 512}, "deployment_config": ZERO_CPU}],
        "code2wav": {"device": "cpu", "cpu_threads": 1, "max_batch_size": 16, "deployment_config": ZERO_CPU},
        "streaming": {"steady_chunk_frames": 8, "left_context_frames": 4},
        "ingress": {"stage_transport": "object_ref", "voices_dir": str(tmp_path_factory.mktemp("objref-voices")),
                    "allow_suppress_eos": True, "deployment_config": {**ZERO_CPU, "num_replicas": 1}},
    }
    serve.run(build_app(args), name=OBJREF, route_prefix=f"/{OBJREF}")
    base = f"{ray_cluster}/{OBJREF}"
    wait_for(lambda: httpx.get(f"{base}/ready", timeout=10).status_code == 200, 120, 0.5, f"/{OBJREF}/ready")
    yield base
    serve.delete(OBJREF, _blocking=False)  # no later test deploys this name: its replicas stop meanwhile


@pytest.mark.parametrize("stream", [False, True])
def test_the_app_serves_speech_over_the_object_ref_transport(objref_app, stream):
    """Every frame's audio arrives, in order, whether the Talker decoded a chunk itself or Code2Wav did, over actor calls."""
    import httpx

    frames = 30  # first chunk, the ramp, steady chunks: the Talker's first-chunk decodes and Code2Wav's
    body = speech(model="fake", voice="vivian", response_format="pcm", stream=stream, max_new_tokens=frames)
    response = httpx.post(f"{objref_app}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert pcm_of(response.content).size == frames * SAMPLES_PER_FRAME
    assert "to_talker;" in response.headers["Server-Timing"]  # the Talker's chunks come as values either way
