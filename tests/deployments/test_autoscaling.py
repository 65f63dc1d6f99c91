"""The queue-depth policies, on Serve's own AutoscalingContext/AutoscalingConfig (no cluster)."""

from __future__ import annotations

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling import code2wav_policy, talker_policy


def _ctx(per_replica: dict[str, list[float]] | None, *, replicas: int, queued: float = 0.0, total: float = 0.0,
         target: float = 24.0) -> AutoscalingContext:
    ids = [f"r{i}" for i in range(replicas)]
    metrics = None if per_replica is None else {k: dict(zip(ids, v, strict=True)) for k, v in per_replica.items()}
    return AutoscalingContext(
        deployment_id=None, deployment_name="Talker:m", app_name="tts", current_num_replicas=replicas,
        target_num_replicas=replicas, running_replicas=ids, total_num_requests=total, total_queued_requests=queued,
        aggregated_metrics=metrics, raw_metrics=None, capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=10, policy_state={}, last_scale_up_time=None, last_scale_down_time=None,
        current_time=None, config=AutoscalingConfig(min_replicas=1, max_replicas=10, target_ongoing_requests=target),
    )


def test_talker_holds_steady_at_target_load():
    ctx = _ctx({"running": [24.0], "waiting": [0.0], "slots": [32.0]}, replicas=1)
    assert talker_policy(ctx) == (1, {})


def test_talker_scales_up_with_waiting_streams_and_handle_queue():
    # 32 running + 10 waiting in the engine + 8 queued at handles over min(target 24, slots 32) per replica
    ctx = _ctx({"running": [32.0], "waiting": [10.0], "slots": [32.0]}, replicas=1, queued=8.0)
    assert talker_policy(ctx)[0] == 3  # ceil(50 / 24)


def test_talker_capacity_is_capped_by_engine_slots():
    # a KV-limited engine reports 8 slots although the target says 24 streams per replica
    ctx = _ctx({"running": [8.0, 8.0], "waiting": [4.0, 4.0], "slots": [8.0, 8.0]}, replicas=2)
    assert talker_policy(ctx)[0] == 3  # ceil(24 / 8)


def test_talker_scales_down_when_idle_but_never_while_streams_wait():
    idle = _ctx({"running": [2.0, 0.0, 0.0], "waiting": [0.0, 0.0, 0.0], "slots": [32.0] * 3}, replicas=3)
    assert talker_policy(idle)[0] == 1
    waiting = _ctx({"running": [2.0, 0.0, 0.0], "waiting": [1.0, 0.0, 0.0], "slots": [32.0] * 3}, replicas=3)
    assert talker_policy(waiting)[0] == 3


def test_talker_falls_back_to_serve_counts_before_metrics_arrive():
    assert talker_policy(_ctx(None, replicas=1, total=50.0))[0] == 3


def test_code2wav_scales_on_chunks_in_flight():
    ctx = _ctx({"inflight_chunks": [40.0], "queued_chunks": [24.0], "max_batch_size": [16.0]}, replicas=1,
               target=16.0)
    assert code2wav_policy(ctx)[0] == 3  # ceil(40 / 16)
    quiet = _ctx({"inflight_chunks": [3.0, 0.0], "queued_chunks": [0.0, 0.0], "max_batch_size": [16.0, 16.0]},
                 replicas=2, target=16.0)
    assert code2wav_policy(quiet)[0] == 1


def test_code2wav_grows_when_more_than_a_batch_waits_per_replica():
    # a low-throughput replica: few chunks in flight per target, but more than a full batch is queued
    ctx = _ctx({"inflight_chunks": [20.0], "queued_chunks": [18.0], "max_batch_size": [16.0]}, replicas=1,
               target=64.0)
    assert code2wav_policy(ctx)[0] == 2


@pytest.mark.parametrize("policy", [talker_policy, code2wav_policy])
def test_policies_are_serve_loadable(policy):
    """The import paths the builder writes load (cloudpickled, as the controller gets them) and decide alike."""
    from ray.serve.config import AutoscalingPolicy

    loaded = AutoscalingPolicy(policy_function=f"deployments.autoscaling:{policy.__name__}").get_policy()
    ctx = _ctx({"running": [30.0], "waiting": [5.0], "slots": [32.0], "inflight_chunks": [40.0],
                "queued_chunks": [20.0], "max_batch_size": [16.0]}, replicas=1, queued=3.0)
    assert loaded.__name__ == policy.__name__
    assert loaded(ctx) == policy(ctx)
