"""Liveness and readiness of the app as one ingress replica sees it (`/health`, `/ready`)."""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse
from ray.serve.handle import DeploymentHandle

from deployments import constants as C
from deployments.ingress.routing import ModelRouter


def health() -> dict:
    """The replica answers: Serve's proxy reached it and its event loop runs."""
    return {"status": "ok"}


async def readiness(router: ModelRouter, code2wav: DeploymentHandle) -> JSONResponse:
    """200 when every Talker and Code2Wav has a warmed-up replica and every model info is loaded, else 503;
    the body says which deployment is ready."""
    probes = {name: r.handle.ready.remote() for name, r in router.routes.items()}
    probes[C.CODE2WAV_DEPLOYMENT_NAME] = code2wav.ready.remote()
    # awaited together: one probe timeout bounds the answer (a poller sees a replica ready that much sooner)
    results = await asyncio.gather(*(_probe(response) for response in probes.values()))
    state = dict(zip(probes, results, strict=True))
    for name, route in router.routes.items():
        if state[name] and route.loaded is None:
            try:
                async with asyncio.timeout(C.READY_PROBE_TIMEOUT_S):
                    await route.info()
            except Exception:
                state[name] = False
    ready = all(state.values())
    return JSONResponse({"ready": ready, "deployments": state}, status_code=200 if ready else 503)


async def _probe(response) -> bool:
    try:
        async with asyncio.timeout(C.READY_PROBE_TIMEOUT_S):
            return bool(await response)
    except Exception:  # not started, still warming up, or failing: not ready
        response.cancel()
        return False
