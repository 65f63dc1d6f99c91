"""Per-key limits across ingress replicas: streams open at once and requests started per minute.

N ingress replicas must not give a key N times its limit, so the counts live in one named Ray actor per app
(`KeyCounters`, detached so that it outlives whichever replica created it; every replica gets it by name). A
replica asks it once per admitted request (`admit`: both limits, one round trip) and tells it when a stream ends
(`release`, not awaited). The local fast path answers without the actor where that is safe:

- a key without limits (or auth off) never reaches it;
- a replica that alone holds a key's stream limit refuses the next stream itself (the global count is at least
  the local one);
- after the actor refused a key for its rate, the replica refuses that key itself until the Retry-After it got
  (no start can leave the window sooner).

A stream's slot is a lease: held until released, or until `lease_s` (the request deadline) passes, so a replica
that dies holding slots frees them at the latest then. If the actor cannot be reached, the replica enforces the
limits of its own requests only (logged) rather than refusing every request.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass

import ray

from deployments.errors import APIError
from deployments.ingress.api_keys import ApiKey

logger = logging.getLogger("ray.serve")

KEY_STREAMS, KEY_RATE = "key_streams", "key_rate"  # the `limit` of a refusal (metrics, logs)
WINDOW_S = 60.0
ACTOR_PREFIX, ACTOR_NAMESPACE = "qwen3-tts-key-counters:", "qwen3_tts"  # one actor per app, found by name


class Counters:
    """Every key's open streams (leases) and recent starts, for all ingress replicas of an app (`KeyCounters`: the
    actor holding one)."""

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._leases: dict[str, dict[str, float]] = defaultdict(dict)  # key id -> {lease: expires (monotonic)}
        self._starts: dict[str, deque[float]] = defaultdict(deque)  # key id -> start times within the window

    def admit(self, key_id: str, max_streams: int | None, per_minute: int | None, stream: bool,
              lease_s: float) -> tuple[str | None, str | None, float]:
        """-> (lease id (None without a stream), refusing limit or None, seconds until a retry may pass)."""
        now = self._clock()
        leases = self._leases[key_id]
        for lease in [k for k, v in leases.items() if v <= now]:
            del leases[lease]
        starts = self._starts[key_id]
        while starts and starts[0] <= now - WINDOW_S:
            starts.popleft()
        if per_minute is not None and len(starts) >= per_minute:
            return None, KEY_RATE, starts[len(starts) - per_minute] + WINDOW_S - now
        if stream and max_streams is not None and len(leases) >= max_streams:
            return None, KEY_STREAMS, 1.0
        if per_minute is not None:
            starts.append(now)
        if not stream:
            return None, None, 0.0
        lease = uuid.uuid4().hex
        leases[lease] = now + lease_s
        return lease, None, 0.0

    def release(self, key_id: str, lease: str) -> None:
        self._leases[key_id].pop(lease, None)

    def counts(self, key_id: str) -> dict[str, int]:
        """The key's open streams and starts in the last minute (tests, operators)."""
        now = self._clock()
        return {"streams": sum(1 for e in self._leases[key_id].values() if e > now),
                "recent_starts": sum(1 for t in self._starts[key_id] if t > now - WINDOW_S)}


KeyCounters = ray.remote(num_cpus=0, max_restarts=-1)(Counters)


@dataclass
class Admission:
    """A request admitted under its key's limits; `release()` when it ends (idempotent)."""

    limits: KeyLimits | None = None
    key: ApiKey | None = None
    lease: str | None = None
    stream: bool = False

    def release(self) -> None:
        limits, self.limits = self.limits, None
        if limits is not None and self.stream:
            limits._released(self)


class KeyLimits:
    """One ingress replica's side of the per-key limits (see the module's docstring)."""

    def __init__(self, app_name: str, lease_s: float):
        self._name = ACTOR_PREFIX + app_name
        self._lease_s = lease_s
        self._actor = None
        self._local_streams: dict[str, int] = defaultdict(int)
        self._blocked_until: dict[str, float] = {}  # key id -> monotonic time the actor's rate refusal lasts to

    def counters(self):
        """The app's KeyCounters actor (created by the first replica that needs it)."""
        if self._actor is None:
            self._actor = KeyCounters.options(name=self._name, namespace=ACTOR_NAMESPACE, lifetime="detached",
                                              get_if_exists=True).remote()
        return self._actor

    async def admit(self, key: ApiKey | None, stream: bool) -> Admission:
        """Admit one request of `key` (a stream holds a slot until released); 429 + Retry-After past a limit."""
        if key is None or (key.requests_per_minute is None and (not stream or key.max_concurrent_streams is None)):
            return self._admitted(key, None, stream)
        now = time.monotonic()
        if (until := self._blocked_until.get(key.id, 0.0)) > now:
            raise _refused(KEY_RATE, until - now, key)
        if stream and key.max_concurrent_streams is not None and \
                self._local_streams[key.id] >= key.max_concurrent_streams:
            raise _refused(KEY_STREAMS, 1.0, key)
        try:
            lease, limit, retry_s = await self.counters().admit.remote(
                key.id, key.max_concurrent_streams, key.requests_per_minute, stream, self._lease_s)
        except (TimeoutError, ray.exceptions.RayError) as e:  # local limits only, until it is back
            logger.warning(f"key counters unavailable ({type(e).__name__}); key={key.label} admitted on local "
                           "counts")
            self._actor = None
            return self._admitted(key, None, stream)
        if limit is not None:
            if limit == KEY_RATE:
                self._blocked_until[key.id] = time.monotonic() + retry_s
            raise _refused(limit, retry_s, key)
        self._blocked_until.pop(key.id, None)
        return self._admitted(key, lease, stream)

    def _admitted(self, key: ApiKey | None, lease: str | None, stream: bool) -> Admission:
        if key is not None and stream:
            self._local_streams[key.id] += 1
        return Admission(self, key, lease, stream)

    def _released(self, admission: Admission) -> None:
        key = admission.key
        if key is None:
            return
        self._local_streams[key.id] -= 1
        if self._local_streams[key.id] <= 0:
            del self._local_streams[key.id]
        if admission.lease is not None and self._actor is not None:
            self._actor.release.remote(key.id, admission.lease)  # not awaited: the lease expires anyway


def _refused(limit: str, retry_s: float, key: ApiKey) -> APIError:
    """The 429 of a key past `limit` (the log line of its request names the key's label: auth.py)."""
    what = "streams open at once" if limit == KEY_STREAMS else "requests per minute"
    return APIError(429, f"this API key is at its limit of {what}; retry later", code="rate_limit_exceeded",
                    retry_after_s=max(1.0, math.ceil(retry_s)), limit=limit)


def held_until_sent(response, release) -> object:
    """`response`, with `release` called once it has been sent: a stream holds its key's slot while it plays."""
    from fastapi.responses import StreamingResponse

    if not isinstance(response, StreamingResponse):
        release()
        return response
    inner = response.body_iterator

    async def body():
        try:
            async for piece in inner:
                yield piece
        finally:
            release()
            if hasattr(inner, "aclose"):
                await inner.aclose()

    response.body_iterator = body()
    return response
