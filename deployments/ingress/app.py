"""The ingress's FastAPI app, and the Serve ingress class made from the plain server class.

ray.serve.llm's `make_fastapi_ingress` pattern: the server class (deployments/ingress/server.py) has
ordinary methods and nothing is decorated at import time. When the application is built, `make_fastapi_app`
creates the app (body guard, OpenAPI document, error handlers) and `make_fastapi_ingress` registers the
class's methods on it from `ENDPOINTS`, then applies `serve.ingress(app)` to the class. By then every
module is fully imported, so Serve pickles the class, its methods and their helpers by reference, as any
importable code: module order and annotations need no care.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import openapi
from deployments.errors import APIError, bad_request
from deployments.http_guard import BodyGuard, BodyLimits

TITLE, VERSION = "Qwen3-TTS on Ray Serve", "0.1.0"

# (HTTP method, path) -> the server method that answers it: one route each, so that each has its own OpenAPI
# operation id (GET and HEAD /health: health_health_get, health_health_head; one route for both gave both
# the first method's id). The order is the OpenAPI document's
# ("WEBSOCKET" routes are not in it: docs/websocket.md describes their messages).
ENDPOINTS: dict[tuple[str, str], str] = {
    ("POST", "/v1/audio/speech"): "speech",
    ("GET", "/v1/models"): "models",
    ("GET", "/v1/audio/voices"): "list_voices",
    ("POST", "/v1/audio/voices"): "upload_voice",
    ("DELETE", "/v1/audio/voices/{name}"): "delete_voice",
    ("WEBSOCKET", "/v1/audio/speech/stream"): "speech_stream",  # live text in (deployments/ingress/live.py)
    ("GET", "/health"): "health",
    ("HEAD", "/health"): "health",
    ("GET", "/ready"): "ready",
}


def make_fastapi_app(body_limits: BodyLimits | None) -> FastAPI:
    """The app without routes: bodies read whole within `body_limits` before any route runs
    (deployments/http_guard.py), `/openapi.json` as the server answers, every error as `{"error": ...}`."""
    app = FastAPI(title=TITLE, version=VERSION)
    app.add_middleware(BodyGuard, limits=body_limits)
    openapi.install(app)  # deployments/openapi.py
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    return app


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
