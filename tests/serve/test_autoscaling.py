"""A Talker deployment scales up under load on its queue-depth policy and back down when idle (CPU, real Serve).

`cv-scale` serves the fake engine (tests/fake_engine.py) with one slot per replica. Streams seeded PAUSE_SEED
hold their slot (4 frames, then nothing) until the test closes them, so the load lasts exactly as long as the
test needs, however slowly the second replica starts. Every wait is on an event: a replica-state change seen
through Serve's status API, or audio arriving on a stream; the timeouts are upper bounds only.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from ray import serve

from tests.serve.conftest import APP, PAUSE_SEED, speech

pytestmark = pytest.mark.serve

DEPLOYMENT = "Talker:cv-scale"
STREAMS = 4  # 1 slot + 1 waiting in the engine (max_ongoing_requests 2), 2 waiting for a slot at the ingress


def _status():
    return serve.status().applications[APP].deployments[DEPLOYMENT]


def _replicas(status=None) -> dict[str, int]:
    states = (status or _status()).replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items() if v}


class _Log:
    """Each change of the deployment's (replica states, status, trigger), with its time since the start."""

    def __init__(self):
        self.t0, self.changes = time.monotonic(), []

    def see(self, status) -> None:
        entry = (_replicas(status), getattr(status.status, "value", status.status),
                 getattr(status.status_trigger, "value", status.status_trigger))
        if not self.changes or self.changes[-1][1:] != entry:
            self.changes.append((round(time.monotonic() - self.t0, 1), *entry))


async def _until(predicate, timeout: float, what: str, log: _Log):
    """Poll Serve's status (off the event loop) until `predicate(status)`; `timeout` is an upper bound."""
    deadline = time.monotonic() + timeout
    while True:
        status = await asyncio.to_thread(_status)
        log.see(status)
        if predicate(status):
            return status
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}; seen: {log.changes}"
        await asyncio.sleep(0.1)


async def _hold(client: httpx.AsyncClient, body: dict, audio: asyncio.Event) -> None:
    """A paused stream, open until cancelled."""
    async with client.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for _data in r.aiter_bytes():
            audio.set()


def test_talker_scales_up_under_load_and_back_down(base_url):
    body = speech(model="cv-scale", seed=PAUSE_SEED, response_format="pcm", stream=True)

    async def scenario() -> dict[str, float]:
        log = _Log()
        await _until(lambda s: _replicas(s) == {"RUNNING": 1}, 120, "one idle replica", log)
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            audio = [asyncio.Event() for _ in range(STREAMS)]
            held = [asyncio.create_task(_hold(client, body, event)) for event in audio]
            started = time.monotonic()
            # the autoscaler's decision: a second replica is asked for
            await _until(lambda s: sum(_replicas(s).values()) == 2, 60, "the decision to scale up", log)
            decided = time.monotonic() - started
            await _until(lambda s: _replicas(s) == {"RUNNING": 2}, 180, "a second running replica", log)
            up = time.monotonic() - started
            # one slot per replica: 2 streams with audio means both replicas serve
            for _ in range(2400):
                assert not any(t.done() for t in held), [t.exception() for t in held if t.done()]
                if sum(e.is_set() for e in audio) >= 2:
                    break
                await asyncio.sleep(0.05)
            assert sum(e.is_set() for e in audio) == 2, "the second replica took no stream"
            for t in held:  # the load ends: the clients go away, the engines drop their streams
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        ended = time.monotonic()
        await _until(lambda s: _replicas(s) == {"RUNNING": 1}, 180, "the scale-down to one replica", log)
        print("replica states (s, states, status, trigger):", log.changes)
        return {"decided": decided, "up": up, "down": time.monotonic() - ended}

    t = asyncio.run(scenario())
    print(f"scale-up decided {t['decided']:.1f} s after the load started, second replica running after "
          f"{t['up']:.1f} s; back to one replica {t['down']:.1f} s after the load ended")
