"""How many `/v1/audio/speech/stream` WebSockets an ingress replica holds, in all and per client address.

Each socket is a coroutine and some memory in the ingress and in Serve's proxy; thousands of idle ones starve
the event loop that also answers /health, /ready and HTTP speech. So a replica holds at most
`ingress.max_websockets_per_replica`, and one client address at most `ingress.max_websockets_per_client`;
beyond, the socket is accepted, told why in one `error` message and closed with 1013 (try again later).
"""

from __future__ import annotations

from collections import Counter

# close codes (RFC 6455): 1000 normal closure (the idle timeout), 1013 try again later (a cap)
CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013


class SocketLimits:
    """The replica's open WebSockets. `admit` -> None (counted: `release` it once) or why it is refused."""

    def __init__(self, per_replica: int, per_client: int):
        self._per_replica, self._per_client = per_replica, per_client
        self._by_client: Counter[str] = Counter()
        self.open = 0

    def admit(self, client: str) -> str | None:
        if self.open >= self._per_replica:
            return f"this server replica holds its limit of {self._per_replica} WebSockets"
        if self._by_client[client] >= self._per_client:
            return f"this client address holds its limit of {self._per_client} WebSockets"
        self.open += 1
        self._by_client[client] += 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        self._by_client[client] -= 1
        if self._by_client[client] <= 0:
            del self._by_client[client]  # no entry per address ever seen: memory returns after close

    def stats(self) -> dict:
        return {"open_websockets": self.open, "client_addresses": len(self._by_client)}
