"""Guards at the HTTP edge of the ingress: request bodies and the replica's open work.

Why here and not in Serve: Serve's proxy hands a request to an ingress replica as soon as its headers
arrive, and the replica pulls the body from the proxy while the request holds one of the replica's
`max_ongoing_requests`. Nothing in Serve times out a body that never comes, and nothing bounds its size:
about 100 half-sent bodies filled the ingress (every route, `/ready` included, answered Serve's
plain-text 429), and a 300 MB chunked body was read whole. So:

- `BodyGuard` (ASGI middleware) reads every body up front, counting bytes as they stream in (413 at the
  limit, chunked bodies included, without reading the rest) within a deadline (408), then replays it.
- The ingress's Serve `max_ongoing_requests` is set high (connections are cheap coroutines; probes and
  half-sent bodies must never wait behind speech), and the costly work is admitted by `OpenWork`: at most
  `ingress.max_open_requests` speech requests and voice uploads per replica, beyond which the ingress
  itself answers 429 JSON with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from ray.exceptions import TaskCancelledError

from deployments.errors import INGRESS_OPEN_REQUESTS, APIError


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int  # 413 above
    read_timeout_s: float  # 408 when the whole body has not arrived by then


class BodyGuard:
    """Pure ASGI middleware (Starlette's BaseHTTPMiddleware would hide `receive` behind its own buffering);
    with `limits` None it passes every request through."""

    def __init__(self, app, limits: BodyLimits | None):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        limits = self.limits
        if scope["type"] != "http" or limits is None:
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > limits.max_bytes:  # refused before reading a byte of it
            await _refuse(_too_large(limits), scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(limits.read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left before its body was complete: nothing to answer
                    body = message.get("body", b"")
                    size += len(body)
                    if size > limits.max_bytes:
                        await _refuse(_too_large(limits), scope, receive, send)
                        return
                    if body:
                        chunks.append(body)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            error = APIError(408, f"the request body did not arrive within {limits.read_timeout_s:g} s",
                             code="body_timeout")
            await _refuse(error, scope, receive, send)
            return
        body = b"".join(chunks)
        del chunks
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            try:
                return await receive()  # after the body: disconnect detection of streaming responses
            except TaskCancelledError:
                # Serve fetches these messages from its proxy with a Ray call, which the proxy cancels when the
                # request ends (its client left, or the response is complete): a disconnect, not an error
                # (Serve would log "Request failed" with a traceback at ERROR)
                return {"type": "http.disconnect"}

        await self.app(scope, replay, send)


def _too_large(limits: BodyLimits) -> APIError:
    return APIError(413, f"request body is larger than {limits.max_bytes} bytes", code="request_too_large")


async def _refuse(error: APIError, scope, receive, send) -> None:
    response = error.response()
    response.headers["Connection"] = "close"  # the rest of the body is not read: this connection is done
    await response(scope, receive, send)


class OpenWork:
    """Speech requests and voice uploads in progress in this replica, at most `limit`; more are a 429.

    A streaming response outlives its handler: the handler is admitted with `admit()`, and the stream,
    once Starlette iterates it, holds its own `acquire(check=False)` until it ends (a response that is
    never iterated, its client gone, leaks nothing).
    """

    def __init__(self, limit: int, retry_after_s: float, status_code: int = 429):
        self.limit, self.retry_after_s, self.status_code = limit, retry_after_s, status_code
        self.count = 0

    def acquire(self, check: bool = True) -> None:
        if check and self.count >= self.limit:
            raise APIError(self.status_code, "the server is at capacity; retry later", code="overloaded",
                           retry_after_s=self.retry_after_s, limit=INGRESS_OPEN_REQUESTS)
        self.count += 1

    def release(self) -> None:
        self.count -= 1

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        self.acquire()
        try:
            yield
        finally:
            self.release()
