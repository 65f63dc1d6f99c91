"""StreamAffinityRouter: Code2Wav's request router (Serve's public request-router interface).

Set as the Code2Wav deployment's `request_router_config` where stream affinity is on (`TTSServingArgs.stream_affinity`):
a call that names a replica (`decode_many(chunks, replica=...)`, named by the ingress's StreamPlacement,
deployments/ingress/placement.py) goes to it while it accepts work (fewer than its `max_ongoing_requests` calls:
it is not otherwise load-aware); when it is full or gone, the call goes by load like any other (power of two
choices on queue length).
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.messages import TARGET_KWARG


class StreamAffinityRouter(RequestRouter):
    """Code2Wav's request router: a call that names a replica goes there first, the others by load."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [_two_of(candidate_replicas)] if candidate_replicas else []
        # every round offers every rank it has: when none of them accepts, Serve waits before the next round
        # (without this, a full deployment spins: each round asks the full replicas for their queue lengths again)
        pending_request.routing_context.should_backoff = True
        target = pending_request.kwargs.get(TARGET_KWARG)
        if target is not None:
            for replica in candidate_replicas:
                if replica.replica_id.unique_id == target:
                    others = [r for r in candidate_replicas if r is not replica]
                    return [[replica], _two_of(others)] if others else [[replica]]
        return [_two_of(candidate_replicas)] if candidate_replicas else []


def _two_of(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Two replicas in random order (Serve then takes the one with the shorter queue that accepts the request, the
    first on a tie: two replicas offered in list order would send every call between idle ones to the first)."""
    return random.sample(replicas, min(2, len(replicas)))
