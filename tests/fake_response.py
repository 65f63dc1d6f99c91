"""FakeResponse: a Serve DeploymentResponse stand-in for tests without a Ray cluster."""

from __future__ import annotations


class FakeResponse:
    """Awaitable once (awaiting it awaits `answer()`, a coroutine function) and cancellable, as a
    DeploymentResponse is."""

    def __init__(self, answer):
        self._answer, self.cancelled = answer, False

    def __await__(self):
        return self._answer().__await__()

    def cancel(self) -> None:
        self.cancelled = True
