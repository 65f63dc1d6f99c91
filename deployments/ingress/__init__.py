"""The ingress: the app's OpenAI-compatible HTTP API (FastAPI on Ray Serve, CPU only), one concern a file.

    app.py       the FastAPI app (body guard, OpenAPI document, error handlers), `ENDPOINTS` (method, path ->
                 server method) and `make_fastapi_ingress`, which registers them and wraps the class for Serve
    server.py    `TTSIngress`, a plain class: one method per endpoint; speech requests admitted and started
    routing.py   served models by name and alias, their `ModelInfo`s, the model of a request without `model`
    speech.py    the speech writers: the whole body, or a stream of raw bytes / SSE events
    sse.py       the SSE events of a stream
    voices.py    the clone prompt a request uses; list, upload and delete uploaded voices (disk in threads)
    health.py    /health and /ready
    outcomes.py  a failure -> the client's JSON error; request metrics

`deployments.builder.build_app` deploys `make_fastapi_ingress(TTSIngress, app=make_fastapi_app(...))`.
"""

from deployments.ingress.app import ENDPOINTS, make_fastapi_app, make_fastapi_ingress
from deployments.ingress.server import TTSIngress

__all__ = ["ENDPOINTS", "TTSIngress", "make_fastapi_app", "make_fastapi_ingress"]
