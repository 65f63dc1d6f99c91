"""The ingress class is built from a plain class and an endpoint map (no cluster): routes, pickling, voices."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

import pytest
from ray import cloudpickle

from deployments.config import TalkerDeploymentConfig
from deployments.ingress import ENDPOINTS, TTSIngress, make_fastapi_app, make_fastapi_ingress
from deployments.ingress.app import build_openapi
from deployments.ingress.http_guard import BodyLimits
from deployments.ingress.routing import ModelRouter
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.voice_store import VoiceStore
from deployments.ingress.voices import Voices
from deployments.messages import ModelInfo
from tests.conftest import tiny_model_info


def _routes(app) -> set[tuple[str, str]]:
    """HTTP routes as the OpenAPI document lists them, and the WebSocket routes (which it cannot list)."""
    from fastapi.routing import APIWebSocketRoute

    doc = build_openapi(app)
    http = {(method.upper(), path) for path, methods in doc["paths"].items() for method in methods}
    def websockets(routes):
        for r in routes:
            if isinstance(r, APIWebSocketRoute):
                yield r.path
            inner = getattr(r, "original_router", None)  # a router included in the app
            if inner is not None:
                yield from websockets(inner.routes)

    return http | {("WEBSOCKET", path) for path in websockets(app.routes)}


def test_every_endpoint_is_routed_to_its_method():
    app = make_fastapi_app(BodyLimits(1000, 1.0))
    make_fastapi_ingress(TTSIngress, app=app)
    assert _routes(app) == set(ENDPOINTS)
    assert all(inspect.iscoroutinefunction(getattr(TTSIngress, name)) for name in ENDPOINTS.values())


def test_building_twice_leaves_the_class_as_written():
    signatures = {name: inspect.signature(getattr(TTSIngress, name)) for name in set(ENDPOINTS.values())}
    docs = []
    for _ in range(2):
        app = make_fastapi_app(None)
        make_fastapi_ingress(TTSIngress, app=app)
        docs.append(build_openapi(app))
    assert docs[0] == docs[1]
    assert {name: inspect.signature(getattr(TTSIngress, name)) for name in signatures} == signatures
    assert not any(hasattr(getattr(TTSIngress, name), "_serve_cls") for name in signatures)


def test_the_server_class_pickles_by_reference():
    # importable code, not a by-value copy of the class and the helpers its methods use
    assert len(cloudpickle.dumps(TTSIngress)) < 200
    assert len(cloudpickle.dumps(make_fastapi_ingress(TTSIngress, app=make_fastapi_app(None)))) > 0


def _router(*infos: ModelInfo) -> ModelRouter:
    """An ingress's model router over Talker handles that answer `info` only."""
    async def answer(info):
        return info

    handles = {i.name: SimpleNamespace(info=SimpleNamespace(remote=lambda i=i: answer(i))) for i in infos}
    return ModelRouter(handles, [TalkerDeploymentConfig(name=i.name) for i in infos])


def _counting_store(tmp_path) -> tuple[VoiceStore, list[tuple[str, bool]]]:
    """A store with the uploaded voice "Alice" that records each name looked up and whether on the event loop."""
    store = VoiceStore(tmp_path)
    store.save("Alice", b"RIFF", None, True, "audio/wav", {})
    looked_up = []

    def find(name, *usable, _find=store.find):
        looked_up.append((name, _on_event_loop()))
        return _find(name, *usable)

    store.find = find
    return store, looked_up


def test_voice_lookups_run_off_the_event_loop(tmp_path):
    store, looked_up = _counting_store(tmp_path)
    voices = Voices(store, router=_router(), limits=None, work=None, outcomes=None)

    async def plan(voice):
        return await voices.finder(SpeechRequest.model_validate({"input": "x", "voice": voice}))

    finder = asyncio.run(plan(" alice "))
    assert finder("alice").name == "Alice" and finder(" alice ") is None
    assert finder("default") is None and finder("") is None and finder("not a name!") is None
    with pytest.raises(LookupError):
        finder("bob")  # planning may only ask about the request's own voice
    assert looked_up == [("alice", False)]
    assert asyncio.run(plan("vivian"))("vivian") is None
    assert asyncio.run(plan("Default"))("Default") is None and len(looked_up) == 2  # no disk read for it


def test_a_preset_voice_is_never_looked_up_in_the_store(tmp_path, tiny_custom_voice):
    store, looked_up = _counting_store(tmp_path)
    info = tiny_model_info("cv", tiny_custom_voice)
    assert "vivian" in info.speakers
    router = _router(info)
    voices = Voices(store, router=router, limits=None, work=None, outcomes=None)

    async def plan(voice):
        return await voices.finder(SpeechRequest.model_validate({"input": "x", "voice": voice}))

    async def scenario():
        before = await plan("vivian")  # the model's info has not arrived: presets unknown, the store is asked
        await router.infos(5.0)
        return before, await plan("Vivian"), await plan("alice")

    before, preset, uploaded = asyncio.run(scenario())
    assert before("vivian") is None and preset("Vivian") is None and preset("vivian") is None
    assert uploaded("alice").name == "Alice"
    assert [name for name, _ in looked_up] == ["vivian", "alice"]  # none for the preset once presets are known
    with pytest.raises(LookupError):
        preset("bob")  # a name that is neither the request's own nor a preset still fails planning loudly


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
