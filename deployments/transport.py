"""How the ingress's calls reach the stages: Serve's handle transport, chosen in one place.

Two transports carry the ingress's calls to the Talker (its batched streams of codec chunks) and to Code2Wav
(`IngressConfig.stage_transport`):

- "grpc": Serve's interdeployment gRPC transport (`_by_reference=False`). Every value travels inside the gRPC
  message, serialized once per hop; no object is created in Ray's object store or its owner tables. Codec chunks
  (a few KB) and PCM answers (<= 100 KB per chunk) are small, so this is the cheap path (ray_serve_design.md §2.5
  and docs/serving.md "Hops and transport" have the cost of each per streamed item).
- "object_ref": Ray actor calls (`_by_reference=True`, Serve's default). The Talker's stream carries lists of chunks
  of several requests (deployments/ingress/talker_calls.py), which the ingress reads as values and sends on to
  Code2Wav inside its calls (chunks are far under Ray's 100 KiB inline limit).

Both ends live here: the ingress's handles (`stage_handle`, `max_answer_bytes`) and Code2Wav's reading of what
arrives (`resolve`: a ref a caller of the deployment's handle sends is read there). `_by_reference` is a Serve
developer API: it is used here and nowhere else, and tests/serve/test_transport.py runs the app end to end over each
transport, so it fails if a Ray upgrade changes it.
"""

from __future__ import annotations

import os
from typing import Literal

from ray import ObjectRef
from ray.serve.handle import DeploymentHandle

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


async def resolve(item):
    """What a Code2Wav call received, as a value: a forwarded ObjectRef (object_ref) is read here, a value as is."""
    return await item if isinstance(item, ObjectRef) else item
