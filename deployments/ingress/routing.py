"""Served models: a request's `model` (or, without one, the request itself) -> that checkpoint's Talker.

Each Talker deployment sends its `ModelInfo` (config, tokenizer, limits) once per ingress replica; the
fetch starts when the replica starts, and concurrent requests share it.

`health` and `readiness`: liveness and readiness of the app as one ingress replica sees it (`/health`, `/ready`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse
from ray.serve.handle import DeploymentHandle

from deployments import constants as C
from deployments.coalescing import ignore_failure
from deployments.config import TalkerDeploymentConfig
from deployments.errors import to_api_error
from deployments.ingress.request_builder import VoiceChoice, choose_voice, infer_model, resolve_model_name
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.voice_aliases import OPENAI_MODEL_NAMES, model_names
from deployments.ingress.voice_store import VoiceRecord
from deployments.messages import ModelInfo


class ModelRoute:
    """One served model: its Talker handle and, once fetched, its ModelInfo (shared by concurrent requests)."""

    def __init__(self, name: str, handle: DeploymentHandle):
        self.name, self.handle = name, handle
        self._info: ModelInfo | None = None
        self._fetch: asyncio.Future | None = None

    @property
    def loaded(self) -> ModelInfo | None:
        """The ModelInfo if it has arrived, without waiting for it."""
        return self._info

    async def info(self) -> ModelInfo:
        if self._info is None:
            if self._fetch is None or (self._fetch.done() and self._fetch.exception() is not None):
                self._fetch = asyncio.ensure_future(self.handle.info.remote())
            self._info = await asyncio.shield(self._fetch)  # one fetch even if a waiting request is cancelled
        return self._info


class ModelRouter:
    """The served models by name, lower-cased name and alias."""

    def __init__(self, talkers: dict[str, DeploymentHandle], models: list[TalkerDeploymentConfig],
                 voice_aliases: dict[str, str] | None = None):
        """`voice_aliases`: other names of preset speakers; OpenAI's model names go to the first model unless a
        model has them as aliases (deployments/ingress/voice_aliases.py)."""
        self.routes = {name: ModelRoute(name, handle) for name, handle in talkers.items()}
        self._models = models
        self.voice_aliases = dict(voice_aliases or {})
        self._names = model_names({n.lower(): m.name for m in models for n in (m.name, *m.aliases)},
                                  models[0].name if models else None)
        self._presets: frozenset[str] | None = None
        self._created = int(time.time())

    def prefetch(self) -> None:
        """Start fetching every model's info now (on the running loop); requests await them."""
        for route in self.routes.values():
            asyncio.ensure_future(route.info()).add_done_callback(ignore_failure)  # the next request retries

    def preset_voices(self) -> frozenset[str] | None:
        """Every served model's preset speakers (lower case), once every model's info has arrived (None before).
        No uploaded voice can take such a name (`POST /v1/audio/voices` refuses it), so a request naming one
        needs no look at the voice store."""
        if self._presets is None and all(r.loaded is not None for r in self.routes.values()):
            self._presets = frozenset(s for r in self.routes.values() for s in r.loaded.speakers)
        return self._presets

    def handle(self, model: str) -> DeploymentHandle:
        return self.routes[model].handle

    async def route(self, body: SpeechRequest,
                    find_voice: Callable[[str], VoiceRecord | None]) -> tuple[ModelInfo, VoiceChoice]:
        """The model and voice of a request; `find_voice` looks up uploaded voices (without blocking)."""
        if body.model:
            info = await self.routes[resolve_model_name(body.model, self._names)].info()
        else:
            infos = await asyncio.gather(*(r.info() for r in self.routes.values()))
            by_name = {i.name: i for i in infos}
            info = by_name[infer_model(body, by_name, find_voice, self.voice_aliases)]
        return info, choose_voice(body, info, find_voice, self.voice_aliases)

    async def infos(self, timeout_s: float) -> list[ModelInfo]:
        """Every model's info, or the APIError of the first that cannot be had within `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                return list(await asyncio.gather(*(r.info() for r in self.routes.values())))
        except Exception as exc:
            raise to_api_error(exc) from None

    def describe(self) -> dict:
        """The `/v1/models` body: every served model, with what its info says once it has arrived."""
        return {"object": "list", "data": [self._model_object(m) for m in self._models]}

    def describe_one(self, model_id: str) -> dict:
        """`GET /v1/models/{id}`: the model a name or alias (OpenAI's included) is served by; 404 if none."""
        name = resolve_model_name(model_id, self._names)
        return self._model_object(next(m for m in self._models if m.name == name))

    def _model_object(self, m: TalkerDeploymentConfig) -> dict:
        aliases = [*m.aliases, *(n for n, served in self._names.items() if served == m.name and n in OPENAI_MODEL_NAMES
                                  and n not in {a.lower() for a in m.aliases})]
        return {"id": m.name, "object": "model", "created": self._created, "owned_by": "qwen3-tts-serve",
                "aliases": aliases, **(info.describe() if (info := self.routes[m.name].loaded) is not None else {})}


def health() -> dict:
    """The replica answers: Serve's proxy reached it and its event loop runs."""
    return {"status": "ok"}


async def readiness(router: ModelRouter, code2wav: DeploymentHandle, aligner: DeploymentHandle | None = None
                    ) -> JSONResponse:
    """200 when every Talker, Code2Wav and (where the config has one) the Aligner has a warmed-up replica and every
    model info is loaded, else 503; the body says which deployment is ready."""
    probes = {name: r.handle.ready.remote() for name, r in router.routes.items()}
    probes[C.CODE2WAV_DEPLOYMENT_NAME] = code2wav.ready.remote()
    if aligner is not None:  # word timestamps asked of an app still warming its aligner would wait for it
        probes[C.ALIGNER_DEPLOYMENT_NAME] = aligner.ready.remote()
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
