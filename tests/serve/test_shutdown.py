"""Downscale, redeploy and app deletion end every open stream visibly, within the graceful timeouts.

A second application (`lc`, at /lc, in the session's cluster) serves the fake engine (tests/fake_engine.py)
with a short Talker `graceful_shutdown_timeout_s` (GRACE_S). Paused streams (PAUSE_SEED: 4 frames, then
nothing) are mid-way for sure and never end on their own, so only the lifecycle event can end them; active
streams (a frame every 50 ms, for 20 s) keep the ingress decoding through Code2Wav while it happens.

Serve drains a stopping Talker replica for its graceful timeout, then kills it: its streams end then, raw ones
cut off without their terminating chunk (an incomplete read), SSE ones with a `speech.audio.error` event. The
ingress drains longer than the Talkers (`deployments/builder.py`), so it is still there to say so when the
whole app stops. A redeploy replaces the Talker replicas a batch at a time (Serve's rolling update), so a
stream whose old Talker replica is not stopped before the old ingress's own graceful timeout is cut off by
the ingress's exit: an incomplete read for SSE too, never a stream that looks complete.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve

from deployments import constants as C
from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import PAUSE_SEED, ZERO_CPU, ClientStream, open_streams, replica_pids, speech, wait_for

pytestmark = pytest.mark.serve

LC = "lc"
PREFIX = "/lc"
TALKER = "Talker:fake"
DEPLOYMENTS = (TALKER, "Code2Wav", "TTSIngress")
GRACE_S = 3.0  # the Talker's graceful_shutdown_timeout_s
INGRESS_GRACE_S = GRACE_S + C.INGRESS_GRACEFUL_SHUTDOWN_MARGIN_S  # the ingress's, by the builder's default
# the controller kills at the deadline (its loop: 0.1 s), the ingress learns of the death, a decode that waits
# for a deleted Code2Wav gives up at its next probe (2 s), the client reads the end; generous for a loaded
# 2-core machine and far below the requests' own deadline (300 s)
MARGIN_S = 30.0
# 60 s at the lc engine's 50 ms per step: still streaming when the lifecycle event comes and its grace has passed,
# however late a loaded machine lands it
ACTIVE_FRAMES = 1200


def lc_args(checkpoint, voices_dir, *, aliases: tuple[str, ...] = (), pause_after_frames: int = 4,
            pause_seed: int | None = PAUSE_SEED) -> dict:
    return {
        "models": [{
            "name": "fake", "aliases": list(aliases), "model": str(checkpoint), "device": "cpu", "cpu_threads": 1,
            "engine_cls": "tests.fake_engine:FakeTalkerEngine",
            "engine_kwargs": {"max_num_seqs": 2, "max_seq_len": 2048, "step_interval_s": 0.05,
                              "pause_seed": pause_seed, "pause_after_frames": pause_after_frames},
            "deployment_config": {**ZERO_CPU, "num_replicas": 2, "max_ongoing_requests": 2,
                                  "max_queued_requests": 4, "graceful_shutdown_timeout_s": GRACE_S},
        }],
        "code2wav": {"device": "cpu", "cpu_threads": 1, "max_batch_size": 16, "deployment_config": ZERO_CPU},
        "streaming": {"first_chunk_frames": 2, "steady_chunk_frames": 8, "left_context_frames": 4},
        "ingress": {"voices_dir": str(voices_dir), "request_timeout_s": 300, "allow_suppress_eos": True,
                    "deployment_config": {**ZERO_CPU, "num_replicas": 1}},
    }


def _deploy(base: str, args: dict, wait: bool = True) -> None:
    from ray.serve.api import _run

    from deployments.builder import build_app

    # external_scaler_enabled: the test scales the Talker as an external autoscaler (KubeRay, the REST API) does
    _run(build_app(args), _blocking=False, name=LC, route_prefix=PREFIX, external_scaler_enabled=True)
    if wait:
        wait_for(lambda: _ready(base), 120, 0.25, "/lc/ready")


def _ready(base: str) -> bool:
    try:
        return httpx.get(f"{base}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _replica_states() -> dict[str, dict[str, int]]:
    """deployment -> replica state -> count, from Serve's status API."""
    app = serve.status().applications.get(LC)
    if app is None:
        return {}
    return {name: {str(getattr(k, "value", k)): v for k, v in d.replica_states.items() if v}
            for name, d in app.deployments.items()}


class _Timeline:
    """Prints the app's replica states as they change, for the record and for failures. Not while this process
    builds an app: Serve's status and config objects are not thread-safe to build (cloudpickle registration)."""

    def __init__(self, since: float):
        self._since, self._stop = since, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = None
        while not self._stop.is_set():
            now = _replica_states()
            if now != last:
                print(f"  {time.monotonic() - self._since:6.2f} s  {now}")
                last = now
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _scale(replicas: int) -> None:
    """What an external autoscaler does: set the Talker deployment's target replica count."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=TALKER, app_name=LC), replicas))


@pytest.fixture(scope="module")
def lc_app(ray_cluster, tiny_custom_voice, tmp_path_factory):
    """-> (base URL of the app, a function of keyword overrides -> its args)."""
    base = f"{ray_cluster}{PREFIX}"
    voices = tmp_path_factory.mktemp("lc_voices")

    def args(**overrides) -> dict:
        return lc_args(tiny_custom_voice, voices, **overrides)

    _deploy(base, args())
    yield base, args
    if LC in serve.status().applications:
        serve.delete(LC)


def _paused(sse: bool) -> dict:
    # as long as an active stream: still open where a redeployed app pauses nothing (the batch-job test's)
    return speech(model="fake", seed=PAUSE_SEED, response_format="pcm", stream=True, max_new_tokens=ACTIVE_FRAMES,
                  **({"stream_format": "sse"} if sse else {}))


def _active(sse: bool) -> dict:
    return speech(model="fake", seed=1, response_format="pcm", stream=True, max_new_tokens=ACTIVE_FRAMES,
                  **({"stream_format": "sse"} if sse else {}))


def _four_streams(base: str) -> list[ClientStream]:
    """Paused and active, raw and SSE; 2 per Talker replica (max_ongoing_requests 2)."""
    return open_streams(base, [_paused(sse=False), _paused(sse=True), _active(sse=False), _active(sse=True)])


def _assert_ended_visibly(streams: list[ClientStream], since: float, what: str, within: float,
                          sse_may_be_cut: bool = False) -> None:
    """Each stream ended within `within` s of `since`, as a failure: raw cut off (no terminating chunk), SSE with
    an error event (or, where `sse_may_be_cut`, cut off as well); none complete, none with a clean end."""
    for s in streams:
        assert s.done.wait(within + 30), f"a stream still open {within + 30:.0f} s after {what}"
    for s in streams:
        print(f"{what}: {'sse' if s.sse else 'raw'} stream ended {s.ended_at - since:.1f} s later, after "
              f"{s.received} bytes: {repr(s.error)[:80] if s.error else s.events[-1]['error']}")
    for s in streams:
        assert s.status == 200
        took = s.ended_at - since
        assert took <= within, f"a stream ended {took:.1f} s after {what}, later than {within:.1f} s"
        if s.sse and s.error is None:
            last = s.events[-1]
            assert last["type"] == "speech.audio.error", last
            # the Talker replica was killed (replica_failed), or its error chunk met a deleted Code2Wav (unavailable)
            assert last["error"]["code"] in ("replica_failed", "unavailable"), last
        else:
            assert not s.sse or sse_may_be_cut, f"an SSE stream without an error event: {s.error!r}"
            assert isinstance(s.error, httpx.RemoteProtocolError), repr(s.error)  # an incomplete read


def test_downscale_ends_the_stopped_replicas_streams_and_spares_the_others(lc_app):
    base, _args = lc_app
    wait_for(lambda: _replica_states().get(TALKER) == {"RUNNING": 2} and _ready(base), 120, 0.25,
             "2 Talker replicas")
    pids = replica_pids(TALKER, LC)
    assert len(pids) == 2
    streams = open_streams(base, [_paused(sse=i % 2 == 1) for i in range(4)])  # 2 on each replica

    _scale(1)
    scaled = time.monotonic()
    wait_for(lambda: sum(s.done.is_set() for s in streams) >= 2, GRACE_S + MARGIN_S + 30, 0.05,
             "the streams of the stopped replica to end")
    ended = [s for s in streams if s.done.is_set()]
    _assert_ended_visibly(ended, scaled, "the downscale", GRACE_S + MARGIN_S)
    wait_for(lambda: len(replica_pids(TALKER, LC)) == 1, 30, 0.1, "the stopped replica's process to exit")
    (survivor,) = replica_pids(TALKER, LC)
    assert survivor in pids
    wait_for(lambda: _replica_states().get(TALKER) == {"RUNNING": 1}, 30, 0.1, "1 Talker replica")
    spared = [s for s in streams if s not in ended]
    assert len(spared) == 2 and not any(s.done.is_set() for s in spared), "a stream of the remaining replica ended"

    _scale(0)  # the last replica: its streams end the same way
    scaled = time.monotonic()
    _assert_ended_visibly(spared, scaled, "the downscale to 0", GRACE_S + MARGIN_S)
    wait_for(lambda: replica_pids(TALKER, LC) == [], 30, 0.1, "the last replica's process to exit")

    _scale(2)
    wait_for(lambda: _replica_states().get(TALKER) == {"RUNNING": 2} and _ready(base), 120, 0.25,
             "2 Talker replicas again")


def test_redeploy_ends_open_streams_and_serves_the_new_config(lc_app):
    base, args = lc_app
    wait_for(lambda: _ready(base), 120, 0.25, "/lc/ready")
    old = {d: replica_pids(d, LC) for d in DEPLOYMENTS}
    streams = _four_streams(base)

    redeployed = time.monotonic()
    # a changed config (an alias, an engine option): Serve replaces every replica, the Talker's in batches
    _deploy(base, args(aliases=("fake-v2",), pause_after_frames=3), wait=False)
    timeline = _Timeline(redeployed)
    try:
        _assert_ended_visibly(streams, redeployed, "the redeploy", INGRESS_GRACE_S + MARGIN_S, sse_may_be_cut=True)
        wait_for(lambda: _ready(base) and _replica_states().get(TALKER) == {"RUNNING": 2}, 120, 0.25,
                 "the new replicas")
    finally:
        timeline.stop()
    # the new replicas serve while the old ingress may still be in its graceful shutdown (Serve checks a draining
    # replica every few seconds): wait for each old process to exit (the CI run of 2026-11-28 checked at once and
    # saw the old ingress STOPPING 1.7 s after its streams had ended)
    for deployment, pids in old.items():
        wait_for(lambda d=deployment, p=pids: not set(p) & set(replica_pids(d, LC)), INGRESS_GRACE_S + MARGIN_S,
                 0.1, f"the old {deployment} replica to exit")
    ok = httpx.post(f"{base}/v1/audio/speech", json=speech(model="fake-v2", response_format="pcm"), timeout=60)
    assert ok.status_code == 200, ok.text[:300]


def test_a_batch_job_survives_a_redeploy_of_its_app(lc_app):
    """A job running while its app is redeployed (a changed config: every replica replaced) completes on the new
    replicas, every item whole: the old ingress gives its items back as it stops, or their leases run out, and the
    new one resumes the job from the store they share (docs/serving.md, "Batch jobs")."""
    base, args = lc_app
    api = f"{base}/v1/audio/speech/batches"
    wait_for(lambda: _ready(base), 120, 0.25, "/lc/ready")
    # 2 s each at the fake engine's 50 ms a frame, 2 at a time; item 0 pauses on the old replicas (its seed) and
    # completes only on the new ones, which pause nothing: the redeploy comes mid-job however slow the machine
    items, frames = 6, 40
    body = {"requests": [speech(model="fake", seed=PAUSE_SEED if i == 0 else 100 + i, response_format="pcm",
                                max_new_tokens=frames) for i in range(items)]}
    submitted = httpx.post(api, json=body, timeout=30)
    assert submitted.status_code == 202, submitted.text
    job = submitted.json()["id"]
    wait_for(lambda: httpx.get(f"{api}/{job}", timeout=10).json()["completed"] >= 1, 60, 0.1, "an item to complete")
    old_ingress = replica_pids("TTSIngress", LC)
    assert httpx.get(f"{api}/{job}", timeout=10).json()["completed"] < items  # the redeploy comes mid-job

    _deploy(base, args(aliases=("fake-v3",), pause_seed=None), wait=False)

    def ended() -> dict | None:
        try:
            status = httpx.get(f"{api}/{job}", timeout=10).json()
        except (httpx.HTTPError, ValueError):  # the ingress being replaced
            return None
        return status if status.get("status") in ("completed", "failed", "cancelled") else None

    status = wait_for(ended, 240, 0.5, "the job to end on the new replicas")
    assert (status["status"], status["completed"], status["failed"]) == ("completed", items, 0), status
    assert not set(old_ingress) & set(replica_pids("TTSIngress", LC)), "the ingress was not replaced"
    for i in range(items):
        audio = httpx.get(f"{api}/{job}/items/{i}", timeout=30)
        assert audio.status_code == 200 and len(audio.content) == frames * SAMPLES_PER_FRAME * 2, (i, audio.text[:200])
    wait_for(lambda: _ready(base), 120, 0.25, "/lc/ready after the redeploy")


def test_deleting_the_app_ends_open_streams_and_stops_every_replica(lc_app):
    base, _args = lc_app
    wait_for(lambda: _ready(base), 120, 0.25, "/lc/ready")
    streams = _four_streams(base)

    deleted = time.monotonic()
    timeline = _Timeline(deleted)
    try:
        serve.delete(LC, _blocking=False)  # every deployment stops at once
        _assert_ended_visibly(streams, deleted, "the app's deletion", GRACE_S + MARGIN_S)
    finally:
        timeline.stop()
    wait_for(lambda: LC not in serve.status().applications, 60, 0.25, "the app to be gone")
    wait_for(lambda: all(replica_pids(d, LC) == [] for d in DEPLOYMENTS), 30, 0.1, "every replica process to exit")
