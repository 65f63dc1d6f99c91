"""deployments/ingress/health.readiness with fake deployment handles (no Ray cluster): its probes run together,
so one slow deployment costs one probe timeout, and a replica that answers is seen as ready."""

from __future__ import annotations

import asyncio
import json
import types

from deployments import constants as C
from deployments.ingress import routing as health
from tests.fake_response import FakeResponse


def _handle(answer):
    return types.SimpleNamespace(ready=types.SimpleNamespace(remote=lambda: FakeResponse(answer)),
                                 info=types.SimpleNamespace(remote=lambda: asyncio.sleep(0, result="info")))


def _router(talker_handle):
    route = types.SimpleNamespace(handle=talker_handle, loaded="info")
    return types.SimpleNamespace(routes={"cv": route})


def test_probes_are_awaited_together(monkeypatch):
    """The Talker's probe answers only once Code2Wav's probe is being awaited: awaited one after the other it
    would time out first and the app would read as not ready."""
    monkeypatch.setattr(C, "READY_PROBE_TIMEOUT_S", 1.0)

    async def main():
        code2wav_asked = asyncio.Event()

        async def talker_ready():
            await code2wav_asked.wait()
            return True

        async def code2wav_ready():
            code2wav_asked.set()
            return True

        return await health.readiness(_router(_handle(talker_ready)), _handle(code2wav_ready))

    response = asyncio.run(main())
    assert response.status_code == 200
    assert json.loads(response.body) == {"ready": True, "deployments": {"cv": True, C.CODE2WAV_DEPLOYMENT_NAME: True}}


def test_a_probe_that_never_answers_is_not_ready_and_is_cancelled(monkeypatch):
    monkeypatch.setattr(C, "READY_PROBE_TIMEOUT_S", 0.05)
    stuck: list[FakeResponse] = []

    async def main():
        never = asyncio.Event()

        async def talker_ready():
            await never.wait()

        async def code2wav_ready():
            return True

        talker = _handle(talker_ready)
        make = talker.ready.remote
        talker.ready.remote = lambda: stuck.append(make()) or stuck[-1]
        return await health.readiness(_router(talker), _handle(code2wav_ready))

    response = asyncio.run(main())
    assert response.status_code == 503
    assert json.loads(response.body)["deployments"] == {"cv": False, C.CODE2WAV_DEPLOYMENT_NAME: True}
    assert stuck and stuck[0].cancelled


def test_a_configured_aligner_is_probed_too(monkeypatch):
    """Word timestamps asked of an app whose Aligner is still warming up (its compiles and graph captures) would
    wait for it: where the config has an Aligner, /ready waits for it as well."""
    monkeypatch.setattr(C, "READY_PROBE_TIMEOUT_S", 0.5)

    async def main(aligner_ready: bool):
        async def yes():
            return True

        async def aligner():
            return aligner_ready

        return await health.readiness(_router(_handle(yes)), _handle(yes), _handle(aligner))

    warming = asyncio.run(main(False))
    assert warming.status_code == 503
    assert json.loads(warming.body)["deployments"] == {"cv": True, C.CODE2WAV_DEPLOYMENT_NAME: True,
                                                       C.ALIGNER_DEPLOYMENT_NAME: False}
    assert asyncio.run(main(True)).status_code == 200
