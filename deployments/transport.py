"""How the ingress's calls reach the stages: Serve's handle transport, chosen in one place.

Two transports carry a chunk from the Talker to the ingress and on to Code2Wav (`IngressConfig.stage_transport`):

- "grpc": Serve's interdeployment gRPC transport (`_by_reference=False`). Every value travels inside the gRPC
  message, serialized once per hop; no object is created in Ray's object store or its owner tables. Codec chunks
  (a few KB) and PCM answers (<= 100 KB per chunk) are small, so this is the cheap path (ray_serve_design.md §2.5
  and docs/serving.md "Hops and transport" have the cost of each per streamed item).
- "object_ref": Ray actor calls (`_by_reference=True`, Serve's default). The ingress turns the Talker's stream into
  an `ObjectRefGenerator` and forwards each chunk's ref to Code2Wav unread. Chunks under Ray's 100 KiB inline
  limit are still stored in the ingress process (it owns the refs) and inlined into the Code2Wav call, so the
  bytes pass through the ingress either way; only their deserialization there is saved.

Both ends live here: the ingress's handles and stream items (`stage_handle`, `stream_items`, `max_answer_bytes`)
and Code2Wav's reading of what arrives (`resolve`). `_by_reference` and
`DeploymentResponseGenerator._to_object_ref_gen` are Serve developer APIs: they are used here and nowhere else, and
tests/serve/test_transport.py runs the app end to end over each transport, so it fails if a Ray upgrade changes
them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Literal

from ray import ObjectRef
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

StageTransport = Literal["grpc", "object_ref"]


def max_answer_bytes(transport: StageTransport) -> int | None:
    """What one call's answer may hold: 3/4 of Serve's gRPC message limit (the rest is headroom for pickling),
    None for actor calls (large results go through the object store)."""
    if transport == "object_ref":
        return None
    return int(os.environ.get("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH", 4 * 1024 * 1024)) * 3 // 4


def stage_handle(handle: DeploymentHandle, transport: StageTransport) -> DeploymentHandle:
    """`handle` set to the transport: every call made through it uses gRPC by value or actor calls by reference."""
    return handle.options(_by_reference=transport == "object_ref")


async def stream_items(generator: DeploymentResponseGenerator, transport: StageTransport) -> AsyncIterator[object]:
    """The items of a streaming call as the next stage takes them: values (gRPC) or ObjectRefs (object_ref)."""
    if transport == "object_ref":
        async for ref in await generator._to_object_ref_gen():
            yield ref
    else:
        async for item in generator:
            yield item


async def resolve(item):
    """What a Code2Wav call received, as a value: a forwarded ObjectRef (object_ref) is read here, a value as is."""
    return await item if isinstance(item, ObjectRef) else item
