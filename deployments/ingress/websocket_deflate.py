"""The ingress's WebSocket answers its clients' offer of per-message compression (permessage-deflate) with no.

Browsers and most client libraries offer permessage-deflate, and uvicorn accepts it by default; then every audio frame
of every live context is deflated on the ingress replica's event loop, in Python's zlib, before it is sent. Audio
barely compresses (PCM of speech by a few percent, encoded formats not at all), and the compression cost most of that
loop's time when it was busiest: at 128 live connections on one H200, 85% of an ingress replica's busy samples were in
`permessage_deflate.encode`, a 2 s PCM frame taking ~4 ms (docs/benchmarks.md, "Live text's first call and the
replicas' event loops"). Declining it (RFC 7692 lets a server accept a connection without the extension) leaves the
client nothing to change.

Ray Serve builds the uvicorn server that an ingress replica runs itself (direct ingress: the fastest recipe, with
HAProxy) once the replica's `__init__` has returned, from uvicorn's `Config` defaults, which Serve does not expose: so
`decline_permessage_deflate()`, called in that `__init__`, makes `ws_per_message_deflate` default to False in this
process. Behind Serve's own proxy actor (no HAProxy) the proxy's uvicorn speaks to the client and still compresses;
that process is Ray's, not this app's. tests/deployments/test_websocket_deflate.py fails if a uvicorn upgrade
changes the setting.
"""

from __future__ import annotations

import functools

_MARK = "_qwen3_tts_no_permessage_deflate"


def decline_permessage_deflate() -> None:
    """uvicorn servers configured from now on in this process accept WebSockets without permessage-deflate (unless
    their config asks for it explicitly). Idempotent."""
    import uvicorn.config

    init = uvicorn.config.Config.__init__
    if getattr(init, _MARK, False):
        return

    @functools.wraps(init)
    def without_deflate(self, *args, **kwargs):
        kwargs.setdefault("ws_per_message_deflate", False)
        init(self, *args, **kwargs)

    setattr(without_deflate, _MARK, True)
    uvicorn.config.Config.__init__ = without_deflate
