"""`/openapi.json` as the server really answers: audio (or SSE) bodies, `{"error": ...}` errors, uploads.

FastAPI derives the document from the route signatures, which says the wrong things here: a JSON 200 for
`/v1/audio/speech` (it returns audio bytes or an event stream), a 422 for bad input (the server answers
400 with `{"error": {...}}`, see `deployments/errors.py`), and no body for `POST /v1/audio/voices` (read by
hand, multipart or JSON). Generated clients and fuzzers believe the document, so it is corrected here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from deployments.audio_formats import MEDIA_TYPES
from deployments.schemas import VoiceUploadJSON


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERROR_TEXT = {
    400: "invalid request (malformed JSON, unknown field, bad value, unknown voice or language, ...)",
    404: "unknown model, voice or route",
    408: "the request body did not arrive within `ingress.body_read_timeout_s`",
    413: "request body or reference audio too large",
    429: "at capacity; retry after `Retry-After` seconds",
    500: "a failure of the server's (logged)",
    503: "a model is not available or its replica failed; retry after `Retry-After` seconds",
    504: "the request's deadline passed",
}
_BODY_ERRORS = (408, 413)  # any request with a body (deployments/http_guard.py)
_ROUTE_ERRORS: dict[tuple[str, str], tuple[int, ...]] = {
    ("/v1/audio/speech", "post"): (400, 404, 429, 500, 503, 504),
    ("/v1/audio/voices", "post"): (400, 429, 500, 503, 504),
    ("/v1/audio/voices", "get"): (500, 503, 504),
    ("/v1/audio/voices/{name}", "delete"): (404,),
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
    }}
    return {"required": True, "content": {
        "multipart/form-data": {"schema": multipart},
        "application/json": {"schema": {"$ref": "#/components/schemas/VoiceUploadJSON"}},
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
            for status in sorted(errors):
                responses[str(status)] = _error(status)
    doc["paths"]["/v1/audio/speech"]["post"]["responses"]["200"] = _speech_ok()
    doc["paths"]["/v1/audio/voices"]["post"]["requestBody"] = _voice_upload_body()
    app.openapi_schema = doc
    return doc


def install(app: FastAPI) -> None:
    """Serve `/openapi.json` (and `/docs`) from `build_openapi`."""
    app.openapi = lambda: build_openapi(app)
