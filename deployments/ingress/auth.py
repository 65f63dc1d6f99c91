"""Who may do what: API keys checked at the edge of the ingress (docs/serving.md "API keys").

Off without a keys file (deployments/ingress/api_keys.py): then every client that can reach the server is trusted.
On, every HTTP request but the open paths (/health, /ready, the OpenAPI document) carries `Authorization: Bearer
KEY`, checked by `AuthGuard` before its body is read: a missing or wrong key is a 401 (one answer for both), a
key without the route's scope a 403. The key found is put in the request's ASGI state (`api_key`) for the routes
(voice ownership, per-key limits). The WebSocket authenticates in `LiveSession` (deployments/ingress/live.py) with
`websocket_token`: the same header, `?api_key=KEY` in its URL, or a first message `{"type": "auth", "api_key": KEY}`
(browsers cannot set headers on a WebSocket).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from deployments.config import AuthConfig
from deployments.errors import APIError
from deployments.ingress.api_keys import SPEECH, VOICES, ApiKey, key_ring

logger = logging.getLogger("ray.serve")

# the playground's page and files are open: the page asks for a key and sends it with each call
OPEN_PATHS = frozenset(("/", "/health", "/ready", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"))
OPEN_PREFIXES = ("/playground/",)
STATE_KEY = "api_key"  # request.state.api_key: the caller's ApiKey (None when auth is off)
# (method, path) -> the scope it needs; any other path needs a valid key of any scope
_ROUTE_SCOPES = {("POST", "/v1/audio/speech"): SPEECH, ("POST", "/v1/audio/voices"): VOICES,
                 ("POST", "/v1/audio/speech/batches"): SPEECH}
_PREFIX_SCOPES = {("DELETE", "/v1/audio/voices/"): VOICES, ("DELETE", "/v1/audio/speech/batches/"): SPEECH}


def unauthorized() -> APIError:
    return APIError(401, "a valid API key is required: `Authorization: Bearer <key>`", code="invalid_api_key")


def forbidden(scope: str) -> APIError:
    return APIError(403, f"this API key lacks the `{scope}` scope", code="insufficient_scope")


class Auth:
    """The ingress's keys (None: auth off) and the checks on a presented key."""

    def __init__(self, config: AuthConfig):
        self._ring = key_ring(config)

    @property
    def enabled(self) -> bool:
        return self._ring is not None

    def check(self, token: str | None, scope: str | None) -> ApiKey | None:
        """The caller's key (None when auth is off); 401 when it is missing or wrong, 403 without `scope`."""
        if self._ring is None:
            return None
        key = self._ring.lookup(token)
        if key is None:
            raise unauthorized()
        if scope is not None and not key.allows(scope):
            raise forbidden(scope)
        return key


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header among ASGI `headers`, or None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() or None if scheme.lower() == "bearer" else None
    return None


def required_scope(method: str, path: str) -> str | None:
    """The scope a route needs (None: any valid key)."""
    if (scope := _ROUTE_SCOPES.get((method, path))) is not None:
        return scope
    return next((s for (m, prefix), s in _PREFIX_SCOPES.items() if m == method and path.startswith(prefix)), None)


def route_path(scope: dict) -> str:
    """The request's path within the app (Serve serves an app under its route prefix, the ASGI root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def websocket_token(scope: dict) -> str | None:
    """A WebSocket's key from its handshake: the Authorization header, else `api_key` in its query string."""
    token = bearer_token(scope.get("headers") or ())
    if token:
        return token
    from urllib.parse import parse_qs

    values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
    return values[0] if values else None


class AuthGuard:
    """ASGI middleware: HTTP requests authenticated before their body is read (an unauthenticated client cannot
    make the ingress buffer bodies). WebSockets pass: their session authenticates (it may wait for a message)."""

    def __init__(self, app, config: AuthConfig | None):
        self.app = app
        self.auth = Auth(config) if config is not None else None
        self._counter = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.auth is None or not self.auth.enabled:
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        status, label = 500, "-"

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            try:
                key = self.auth.check(bearer_token(scope.get("headers") or ()), required_scope(scope["method"], path))
            except APIError as error:
                response = error.response()
                if error.status == 401:
                    response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send_status)
                return
            label = key.label
            scope.setdefault("state", {})[STATE_KEY] = key
            await self.app(scope, receive, send_status)
        finally:
            # the request's log line and count by key: the key's hash prefix, never the key
            logger.info(f"{scope['method']} {path[:200]} {status} key={label}")
            self._requests().inc(tags={"key": label, "status": str(status)})

    def _requests(self):
        if self._counter is None:
            from ray.serve import metrics

            self._counter = metrics.Counter("tts_key_requests", description=(
                "HTTP requests by API key (`key`: sha256 prefix of the key; `-`: none or a wrong one) and status, "
                "when the server has API keys."), tag_keys=("key", "status"))
        return self._counter


def caller(request) -> ApiKey | None:
    """The key `AuthGuard` found for an HTTP request (None when auth is off)."""
    return getattr(request.state, STATE_KEY, None)


# ------------------------------------------------------------------ uploaded voices (owner: the uploader key's id)
def may_use(owner: str | None, key: ApiKey | None) -> bool:
    """Whether `key` may see and speak with a voice of `owner`: auth off, admin, its owner, or a voice uploaded
    while the server had no keys (owner None: shared)."""
    return key is None or owner is None or key.admin or owner == key.id


def may_change(owner: str | None, key: ApiKey | None) -> bool:
    """Whether `key` may replace or delete a voice of `owner`: auth off, admin, or its owner."""
    return key is None or key.admin or (owner is not None and owner == key.id)
