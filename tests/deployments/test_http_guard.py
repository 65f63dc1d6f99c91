"""BodyGuard (deployments/ingress/http_guard.py) as plain ASGI, without Serve: what the app sees of `receive`."""

from __future__ import annotations

import asyncio

from ray.exceptions import TaskCancelledError

from deployments.ingress.http_guard import BodyGuard, BodyLimits


def _run(messages: list, app_receives: int) -> list:
    """Messages the app behind the guard receives; `messages` are what Serve's receive gives (or raises)."""
    queue = list(messages)
    seen: list = []

    async def receive():
        item = queue.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def send(_message):
        pass

    async def app(scope, receive, send):
        for _ in range(app_receives):
            seen.append(await receive())

    guard = BodyGuard(app, BodyLimits(max_bytes=1000, read_timeout_s=5))
    asyncio.run(guard({"type": "http", "headers": []}, receive, send))
    return seen


def test_the_body_is_replayed_whole_then_receive_passes_through():
    seen = _run([{"type": "http.request", "body": b"ab", "more_body": True},
                 {"type": "http.request", "body": b"c", "more_body": False}, {"type": "http.disconnect"}], 2)
    assert seen == [{"type": "http.request", "body": b"abc", "more_body": False}, {"type": "http.disconnect"}]


def test_a_cancelled_receive_after_the_body_is_a_disconnect_not_an_error():
    """Serve fetches the messages after the body from its proxy with a Ray call that the proxy cancels when the
    request ends: the app (a streaming response listening for the client's disconnect) sees a disconnect, where
    the TaskCancelledError made Serve log "Request failed" at ERROR with a traceback."""
    seen = _run([{"type": "http.request", "body": b"{}", "more_body": False},
                 TaskCancelledError("the proxy's receive was cancelled")], 2)
    assert seen[1] == {"type": "http.disconnect"}
