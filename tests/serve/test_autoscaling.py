"""A Talker deployment scales up under load on its queue-depth policy and back down when idle (CPU)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from tests.serve.conftest import APP, speech, wait_for

pytestmark = pytest.mark.serve

DEPLOYMENT = "Talker:cv-scale"


def _replicas() -> dict[str, int]:
    states = serve.status().applications[APP].deployments[DEPLOYMENT].replica_states
    return {str(getattr(k, "value", k)): v for k, v in states.items()}


def test_talker_scales_up_under_load_and_back_down(base_url):
    assert _replicas() == {"RUNNING": 1}
    body = speech(model="cv-scale", response_format="pcm", max_new_tokens=120)

    def one(i: int) -> int:
        return httpx.post(f"{base_url}/v1/audio/speech", json={**body, "seed": i}, timeout=300).status_code

    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        results = [pool.submit(one, i) for i in range(4)]  # 1 slot per replica: 3 streams wait
        wait_for(lambda: _replicas().get("RUNNING", 0) == 2, 120, 0.25, "a second Talker replica")
        scaled_up = time.monotonic() - started
        statuses = [r.result() for r in results]
    assert statuses == [200] * 4
    done = time.monotonic()
    wait_for(lambda: _replicas() == {"RUNNING": 1}, 120, 0.25, "scale down to one replica")
    print(f"2 replicas {scaled_up:.1f} s after the load started; back to 1 "
          f"{time.monotonic() - done:.1f} s after it ended")
