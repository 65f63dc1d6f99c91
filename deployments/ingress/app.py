"""The ingress's FastAPI app, and the Serve ingress class made from the plain server class.

ray.serve.llm's `make_fastapi_ingress` pattern: the server class (deployments/ingress/server.py) has
ordinary methods and nothing is decorated at import time. When the application is built, `make_fastapi_app`
creates the app (body guard, OpenAPI document, error handlers) and `make_fastapi_ingress` registers the
class's methods on it from `ENDPOINTS`, then applies `serve.ingress(app)` to the class. By then every
module is fully imported, so Serve pickles the class, its methods and their helpers by reference, as any
importable code: module order and annotations need no care.

`build_openapi`: `/openapi.json` as the server really answers. FastAPI derives the document from the route
signatures, which says the wrong things here: a JSON 200 for `/v1/audio/speech` (it returns audio bytes or an
event stream), a 422 for bad input (the server answers 400 with `{"error": {...}}`, see `deployments/errors.py`),
and no body for `POST /v1/audio/voices` (read by hand, multipart or JSON). Generated clients and fuzzers believe
the document, so it is corrected here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.audio.formats import MEDIA_TYPES
from deployments.config import AuthConfig
from deployments.errors import APIError, bad_request
from deployments.ingress.auth import OPEN_PATHS, AuthGuard
from deployments.ingress.http_guard import BodyGuard, BodyLimits
from deployments.ingress.schemas import VoiceUploadJSON

TITLE, VERSION = "Qwen3-TTS on Ray Serve", "0.1.0"
# the web playground: static files served as they are (no build step), the page at `/` (docs/playground.md)
PLAYGROUND_DIR = Path(__file__).with_name("playground")

# (HTTP method, path) -> the server method that answers it: one route each, so that each has its own OpenAPI
# operation id (GET and HEAD /health: health_health_get, health_health_head; one route for both gave both
# the first method's id). The order is the OpenAPI document's
# ("WEBSOCKET" routes are not in it: docs/websocket.md describes their messages).
ENDPOINTS: dict[tuple[str, str], str] = {
    ("POST", "/v1/audio/speech"): "speech",
    ("GET", "/v1/models"): "models",
    ("GET", "/v1/models/{model_id}"): "model",
    ("GET", "/v1/audio/voices"): "list_voices",
    ("POST", "/v1/audio/voices"): "upload_voice",
    ("DELETE", "/v1/audio/voices/{name}"): "delete_voice",
    ("POST", "/v1/audio/speech/batches"): "submit_batch",  # batch jobs (deployments/ingress/batch_jobs.py)
    ("GET", "/v1/audio/speech/batches/{batch_id}"): "batch_status",
    ("GET", "/v1/audio/speech/batches/{batch_id}/items/{index}"): "batch_item",
    ("DELETE", "/v1/audio/speech/batches/{batch_id}"): "cancel_batch",
    ("WEBSOCKET", "/v1/audio/speech/stream"): "speech_stream",  # live text in (deployments/ingress/live.py)
    ("GET", "/health"): "health",
    ("HEAD", "/health"): "health",
    ("GET", "/ready"): "ready",
}


def make_fastapi_app(body_limits: BodyLimits | None, auth: AuthConfig | None = None) -> FastAPI:
    """The app without the server's routes: API keys checked when `auth` names a keys file
    (deployments/ingress/auth.py), then bodies read whole within `body_limits` before any route runs
    (deployments/ingress/http_guard.py), `/openapi.json` as the server answers, every error as `{"error": ...}`,
    and the web playground (`/` and its files under `/playground/`)."""
    app = FastAPI(title=TITLE, version=VERSION)
    app.add_middleware(BodyGuard, limits=body_limits)
    app.add_middleware(AuthGuard, config=auth)  # added last: runs first, before a body is read
    _install_openapi(app)  # deployments/ingress/app.py
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_api_route("/", _playground_page, methods=["GET"], include_in_schema=False)
    app.mount("/playground", StaticFiles(directory=PLAYGROUND_DIR), name="playground")
    return app


async def _playground_page() -> FileResponse:
    return FileResponse(PLAYGROUND_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def make_fastapi_ingress(cls: type, *, app: FastAPI, endpoints: dict[tuple[str, str], str] = ENDPOINTS) -> type:
    """`cls` with `endpoints` registered on `app` and the app attached: the class for `serve.deployment`."""
    for (http_method, path), name in endpoints.items():
        if http_method == "WEBSOCKET":
            app.add_api_websocket_route(path, _endpoint(cls, name))
        else:
            app.api_route(path, methods=[http_method])(_endpoint(cls, name))
    return serve.ingress(app)(cls)


def _endpoint(cls: type, name: str) -> Callable:
    """A function of this app's own for `cls.<name>`: Serve rewrites the signature of each route's function
    (`self` becomes a dependency on the replica's instance), which must not touch the class's method."""
    method = getattr(cls, name)

    @functools.wraps(method)  # name, docstring (the OpenAPI summary and description) and signature
    async def endpoint(self, *args, **kwargs):
        return await method(self, *args, **kwargs)

    return endpoint


async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    if first.get("type") == "json_invalid":  # loc holds the character offset, not a field
        return bad_request(f"request body is not valid JSON: {first.get('ctx', {}).get('error', 'parse error')}",
                           code="invalid_json").response()
    return bad_request(f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}", ".".join(loc) or None).response()


async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None).response()


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERROR_TEXT = {
    400: "invalid request (malformed JSON, unknown field, bad value, unknown voice or language, ...)",
    401: "a valid API key is required (`Authorization: Bearer <key>`; only when the server has API keys)",
    403: "the API key lacks the scope this route needs",
    404: "unknown model, voice, batch or route",
    409: "the batch item is not ready yet (`not_ready`, retry after `Retry-After` seconds) or was cancelled; a "
         "voice of this name exists (`voice_exists`: `replace: true` replaces one's own)",
    408: "the request body did not arrive within `ingress.body_read_timeout_s`",
    413: "request body or reference audio too large",
    429: "at capacity, or the API key at its limit; retry after `Retry-After` seconds",
    500: "a failure of the server's (logged)",
    503: "a model is not available, its replica failed, or the batch store cannot be written (disk full, storage "
         "unreachable); retry after `Retry-After` seconds",
    504: "the request's deadline passed",
}
_BODY_ERRORS = (408, 413)  # any request with a body (deployments/ingress/http_guard.py)
_AUTH_ERRORS = (401, 403)  # any route but the open ones, when the server has API keys (deployments/ingress/auth.py)
_ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("/v1/audio/speech", "post"): (400, 404, 429, 500, 503, 504),
    ("/v1/audio/voices", "post"): (400, 409, 429, 500, 503, 504),
    ("/v1/audio/voices", "get"): (500, 503, 504),
    ("/v1/audio/voices/{name}", "delete"): (404,),
    ("/v1/models/{model_id}", "get"): (404,),
    ("/v1/audio/speech/batches", "post"): (400, 503),
    ("/v1/audio/speech/batches/{batch_id}", "get"): (404, 503),
    ("/v1/audio/speech/batches/{batch_id}", "delete"): (404, 503),
    ("/v1/audio/speech/batches/{batch_id}/items/{index}", "get"): (400, 404, 409, 500, 503, 504),  # 400/500/504: a
    # failed item's own error, as /v1/audio/speech answered it
    ("/ready", "get"): (503,),
}


def _error(status: int) -> dict[str, Any]:
    return {"description": _ERROR_TEXT[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def _speech_ok() -> dict[str, Any]:
    binary = {"schema": {"type": "string", "format": "binary"}}
    content = {media: binary for media in dict.fromkeys(MEDIA_TYPES.values())}
    content["text/event-stream"] = {"schema": {"type": "string", "description": (
        "`data: {\"type\": \"speech.audio.delta\", \"audio\": <base64>}` events, then `speech.audio.done` "
        "(usage, finish_reason) or `speech.audio.error`")}}
    return {"description": "the audio: one body in `response_format`; streamed raw or as SSE "
                           "(`stream_format: sse`). A raw stream that fails mid-way ends without its terminating "
                           "chunk.", "content": content}


def _voice_upload_body() -> dict[str, Any]:
    multipart = {"type": "object", "required": ["audio_sample", "name"], "properties": {
        "audio_sample": {"type": "string", "format": "binary", "description": "the reference clip (wav, flac, ...)"},
        "name": {"type": "string", "description": "[A-Za-z0-9][A-Za-z0-9_-]{0,63}, not a preset speaker"},
        "ref_text": {"type": "string", "description": "transcript; without it the voice is x-vector only"},
        "x_vector_only_mode": {"type": "boolean", "default": False},
        "consent": {"type": "string", "description": "the speaker's consent (OpenAI: a consent id), stored"},
        "replace": {"type": "boolean", "default": False,
                    "description": "replace one's own voice of this name (else 409 voice_exists)"},
    }}
    return {"required": True, "content": {
        "multipart/form-data": {"schema": multipart},
        "application/json": {"schema": {"$ref": "#/components/schemas/VoiceUploadJSON"}},
    }}


def _batch_body() -> dict[str, Any]:
    jsonl = {"type": "string", "description": "one `/v1/audio/speech` request body (JSON) a line"}
    return {"required": True, "content": {
        "application/json": {"schema": {"type": "object", "required": ["requests"], "properties": {
            "requests": {"type": "array", "items": {"$ref": "#/components/schemas/SpeechRequest"}}}}},
        "application/x-ndjson": {"schema": jsonl},
        "multipart/form-data": {"schema": {"type": "object", "required": ["file"], "properties": {
            "file": {"type": "string", "format": "binary", "description": "the JSONL requests"}}}},
    }}


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The corrected document (cached on the app, as FastAPI does)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")["$defs"])
    schemas["ErrorResponse"] = {k: v for k, v in ErrorResponse.model_json_schema(
        ref_template="#/components/schemas/{model}").items() if k != "$defs"}
    schemas["VoiceUploadJSON"] = VoiceUploadJSON.model_json_schema(ref_template="#/components/schemas/{model}")
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for path, methods in doc.get("paths", {}).items():
        for method, operation in methods.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            errors = set(_ROUTE_ERRORS.get((path, method), ()))
            if method in ("post", "put", "patch"):
                errors.update(_BODY_ERRORS)
            if path not in OPEN_PATHS:
                errors.update(_AUTH_ERRORS)
            for status in sorted(errors):
                responses[str(status)] = _error(status)
    doc["paths"]["/v1/audio/speech"]["post"]["responses"]["200"] = _speech_ok()
    doc["paths"]["/v1/audio/voices"]["post"]["requestBody"] = _voice_upload_body()
    batches = doc["paths"]["/v1/audio/speech/batches"]["post"]
    batches["requestBody"] = _batch_body()
    batches["responses"]["202"] = batches["responses"].pop("200")
    batches["responses"]["202"]["description"] = "accepted: the job's id and status (GET it for progress)"
    app.openapi_schema = doc
    return doc


def _install_openapi(app: FastAPI) -> None:
    """Serve `/openapi.json` (and `/docs`) from `build_openapi`."""
    app.openapi = lambda: build_openapi(app)
