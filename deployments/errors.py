"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with the right HTTP status.

Only the ingress turns exceptions into HTTP; everything below it raises typed errors
(`stages.contract.InvalidRequestError` = the request's fault, anything else = ours).
"""

from __future__ import annotations

import logging
import math

from fastapi.responses import JSONResponse

logger = logging.getLogger("ray.serve")

# an error message is for a person: bounded, whatever the client sent (a 1 MB voice name is not echoed back)
MAX_MESSAGE_CHARS = 1000
MAX_SHOWN_CHARS = 64

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    409: "invalid_request_error",
    404: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_overloaded",
    504: "timeout_error",
}


# which limit refused an overloaded request: an ingress replica's open requests (`ingress.max_open_requests`), a
# deployment handle's queue (Serve's `max_queued_requests` of the Talker or Code2Wav), or a Talker engine's
# waiting queue (`engine_kwargs.max_waiting`)
INGRESS_OPEN_REQUESTS, SERVE_QUEUE, ENGINE_QUEUE = "ingress_open_requests", "serve_queue", "engine_queue"
OVERLOAD_LIMITS = (INGRESS_OPEN_REQUESTS, SERVE_QUEUE, ENGINE_QUEUE)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, limit: str | None = None):
        """`limit`: for an overload, which limit refused the request (OVERLOAD_LIMITS; logged and counted by
        the ingress, never sent: the client's answer is the same whichever it was)."""
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + "..."
        if param is not None and len(param) > MAX_SHOWN_CHARS:
            param = param[:MAX_SHOWN_CHARS] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s, self.limit = retry_after_s, limit

    def __reduce__(self):
        """Pickled whole: a deployment's APIError (the Aligner's 400s) reaches the ingress through Ray as raised
        (Exception's default pickling would call __init__ with the message alone)."""
        return self.__class__, (self.status, self.message), self.__dict__

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class StreamAborted(Exception):
    """Raised out of a raw audio stream that failed after its status line: the HTTP response is cut off."""


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """`repr` of a client-supplied value for an error message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..." + text[0]


def plain(text: object) -> str:
    """A library's error text made fit for a client: first line, no object reprs with heap addresses."""
    import re

    line = (str(text).splitlines() or [""])[0]
    return re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "<...>", line)[:MAX_MESSAGE_CHARS // 2]


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unwrap(exc: BaseException) -> BaseException:
    """The user exception inside Ray's wrappers (a failed task, or a task whose argument failed)."""
    from ray.exceptions import RayTaskError

    seen = 0
    while isinstance(exc, RayTaskError) and seen < 8:
        cause = getattr(exc, "cause", None)
        if cause is None or cause is exc:
            break
        exc, seen = cause, seen + 1
    return exc


def replica_failed(retry_after_s: float = 1.0) -> APIError:
    """The answer to a request whose replica failed under it (died, or found its engine stuck): transient, 503."""
    return APIError(503, "the replica serving this request failed; retry", code="replica_failed",
                    retry_after_s=retry_after_s)


def to_api_error(exc: BaseException, *, overload_status: int = 503, retry_after_s: float = 1.0) -> APIError:
    """Map whatever a handle call raised to the answer the client gets."""
    from ray.exceptions import RayActorError, TaskCancelledError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from deployments.messages import ReplicaFullError
    from stages.contract import EngineOverloadedError, InvalidRequestError, LiveTextEvictedError, TextTimeoutError

    exc = unwrap(exc)
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, StarletteHTTPException):  # raised by Starlette while reading a request
        return APIError(exc.status_code, plain(exc.detail))
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc))
    if isinstance(exc, (BackPressureError, EngineOverloadedError, ReplicaFullError)):
        return APIError(overload_status, "the server is at capacity; retry later", code="overloaded",
                        retry_after_s=retry_after_s,
                        limit=ENGINE_QUEUE if isinstance(exc, EngineOverloadedError) else SERVE_QUEUE)
    if isinstance(exc, DeploymentUnavailableError):
        return APIError(503, "the model is not available right now", code="unavailable", retry_after_s=retry_after_s)
    if isinstance(exc, LiveTextEvictedError):  # live text: its slot went to waiting work, or its lifetime ended
        return APIError(408, str(exc), code="text_evicted")
    if isinstance(exc, TextTimeoutError):  # live text (WebSocket): the client's text stopped coming
        return APIError(408, str(exc), code="text_timeout")
    if isinstance(exc, TimeoutError):
        return APIError(504, "the request did not finish before its deadline", code="timeout")
    if isinstance(exc, RayActorError):  # a replica died (killed, OOM, node lost): transient for the client
        return replica_failed(retry_after_s)
    if isinstance(exc, TaskCancelledError):
        return APIError(503, "the request was cancelled by the server", code="cancelled", retry_after_s=retry_after_s)
    # ours, not the client's: the details (Ray's ActorDiedError text, addresses, tracebacks) go to the log only
    logger.error(f"request failed: {type(exc).__name__}: {exc}")
    return APIError(500, "speech generation failed (internal error); it was logged", code="internal_error")
