"""Deployment-level autoscaling policies on queue depth (`autoscaling_config.policy.policy_function`).

Each returns the raw desired replica count; Serve applies upscale/downscale delays, factors and
[min, max] bounds afterwards. They run on the controller every tick and are cloudpickled there:
stdlib only, cheap. Inputs are the replicas' `record_autoscaling_stats()` (aggregated over
`look_back_period_s`) plus requests queued at handles, which no replica has seen yet.

- Talker: demand = waiting + running streams (engine truth) + streams queued at handles; capacity per
  replica = min(target_ongoing_requests, engine slots). Never scales down while streams wait for a slot.
- Code2Wav: demand = chunks in flight (queued + decoding) + chunks queued at handles; capacity per
  replica = target_ongoing_requests (default: one full batch).
"""

from __future__ import annotations

import math
from typing import Any


def _sum(metrics: dict[str, dict[Any, float]] | None, key: str) -> float | None:
    per_replica = (metrics or {}).get(key)
    if not per_replica:
        return None
    return float(sum(per_replica.values()))


def _mean(metrics: dict[str, dict[Any, float]] | None, key: str) -> float | None:
    per_replica = (metrics or {}).get(key)
    if not per_replica:
        return None
    return float(sum(per_replica.values())) / len(per_replica)


def talker_policy(ctx) -> tuple[float, dict[str, Any]]:
    """Scale Talker replicas so that streams (running + waiting for a slot) fit the engine slots."""
    metrics = ctx.aggregated_metrics
    target = float(ctx.config.get_target_ongoing_requests())
    running, waiting = _sum(metrics, "running"), _sum(metrics, "waiting")
    if running is None or waiting is None:  # no replica has reported yet: Serve's own count
        return math.ceil(ctx.total_num_requests / target), {}
    slots = _mean(metrics, "slots")
    capacity = min(target, slots) if slots else target
    demand = running + waiting + float(ctx.total_queued_requests or 0.0)
    desired = math.ceil(demand / capacity) if capacity > 0 else ctx.current_num_replicas
    if waiting > 0 or ctx.total_queued_requests:  # streams are waiting: never shrink now
        desired = max(desired, ctx.current_num_replicas)
    return desired, {}


def code2wav_policy(ctx) -> tuple[float, dict[str, Any]]:
    """Scale Code2Wav replicas on chunks waiting to be decoded."""
    metrics = ctx.aggregated_metrics
    target = float(ctx.config.get_target_ongoing_requests())
    inflight = _sum(metrics, "inflight_chunks")
    if inflight is None:
        return math.ceil(ctx.total_num_requests / target), {}
    demand = inflight + float(ctx.total_queued_requests or 0.0)
    desired = math.ceil(demand / target) if target > 0 else ctx.current_num_replicas
    queued = _sum(metrics, "queued_chunks") or 0.0
    batch = _mean(metrics, "max_batch_size") or target
    if queued > batch * max(ctx.current_num_replicas, 1):  # more than a batch waiting per replica: grow
        desired = max(desired, ctx.current_num_replicas + 1)
    return desired, {}
