"""deployments/transport.py against real Serve: both stage transports carry a stream into a second deployment.

The "object_ref" transport relies on Serve developer APIs (`_by_reference`, `_to_object_ref_gen`); this test is
where a Ray upgrade that changes them fails first.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.transport import stage_handle, stream_items

pytestmark = pytest.mark.serve

APP = "transport-test"


@pytest.fixture(scope="module")
def handles(ray_cluster):
    import ray
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
            values = [await item if isinstance(item, ray.ObjectRef) else item for item in items]
            return [v["seq"] + len(v["payload"]) for v in values]

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, producer, consumer):
            self._producer, self._consumer = producer, consumer

        async def run(self, transport: str, n: int) -> tuple[list[str], list[int]]:
            """In a replica, as the ingress does: the producer's stream forwarded to the consumer."""
            generator = stage_handle(self._producer, transport).options(stream=True).numbers.remote(n)
            items = [item async for item in stream_items(generator, transport)]
            kinds = [type(item).__name__ for item in items]
            return kinds, await stage_handle(self._consumer, transport).total.remote(items)

    serve.run(Front.bind(Producer.bind(), Consumer.bind()), name=APP, route_prefix=None)
    yield serve.get_app_handle(APP)
    serve.delete(APP)


@pytest.mark.parametrize("transport, kind", [("grpc", "dict"), ("object_ref", "ObjectRef")])
def test_a_stream_reaches_the_next_stage(handles, transport, kind):
    kinds, totals = handles.run.remote(transport, 5).result(timeout_s=60)
    assert kinds == [kind] * 5
    assert totals == [i + 2000 for i in range(5)]


def test_the_grpc_transport_carries_values_from_a_driver_too(handles):
    """The handle options themselves (no replica around them): what `stage_handle` sets is accepted by Serve."""
    from ray import serve

    async def run():
        producer = serve.get_deployment_handle("Producer", app_name=APP)
        generator = stage_handle(producer, "grpc").options(stream=True).numbers.remote(3)
        return [item["seq"] async for item in stream_items(generator, "grpc")]

    assert asyncio.run(run()) == [0, 1, 2]
