"""API keys (deployments/ingress/api_keys.py), the HTTP guard and voice ownership (deployments/ingress/auth.py),
per-key limits (deployments/ingress/rate_limits.py): no Ray, the guard in a plain Starlette app."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from deployments.config import AuthConfig
from deployments.errors import APIError
from deployments.ingress.api_keys import KeyRing, key_digest, parse_keys
from deployments.ingress.auth import Auth, AuthGuard, bearer_token, caller, may_change, may_use, websocket_token
from deployments.ingress.rate_limits import KEY_RATE, KEY_STREAMS, Counters, KeyLimits

DEFAULTS = AuthConfig(max_concurrent_streams=4, requests_per_minute=100)
KEYS = """
# the team's keys
sk-speaker-0001   speech
sk-uploader-0002  speech,voices   streams=2 rpm=0
sk-admin-0003     admin
bad line without scopes
sk-typo-0004      speech,sing
sk-opt-0005       speech          burst=3
"""


class _Lines(logging.Handler):
    """The messages of the ingress's logger (`ray.serve` does not propagate to pytest's caplog)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logger = logging.getLogger("ray.serve")
        self._level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self.messages

    def __exit__(self, *exc):
        logging.getLogger("ray.serve").removeHandler(self)
        logging.getLogger("ray.serve").setLevel(self._level)


def _ring(tmp_path, text=KEYS) -> KeyRing:
    path = tmp_path / "keys"
    path.write_text(text)
    return KeyRing(path, DEFAULTS)


def test_a_keys_file_parses_scopes_and_limits_and_skips_bad_lines_without_their_text():
    with _Lines() as lines:
        keys = parse_keys(KEYS, DEFAULTS)
    assert len(keys) == 3
    speaker, uploader, admin = (keys[key_digest(k)] for k in ("sk-speaker-0001", "sk-uploader-0002", "sk-admin-0003"))
    assert speaker.scopes == {"speech"} and speaker.max_concurrent_streams == 4 and speaker.requests_per_minute == 100
    assert uploader.max_concurrent_streams == 2 and uploader.requests_per_minute is None  # 0: no limit
    assert admin.allows("voices") and admin.allows("speech") and not speaker.allows("voices")
    assert speaker.label == key_digest("sk-speaker-0001").hex()[:8]
    # each bad line is named by its number, never by its text (it holds a key)
    assert [m[:18] for m in lines] == ["keys file, line 6:", "keys file, line 7:", "keys file, line 8:"]
    assert not any("sk-typo" in m or "sk-opt" in m for m in lines)


def test_lookup_finds_the_key_and_answers_none_for_missing_or_wrong(tmp_path):
    ring = _ring(tmp_path)
    assert ring.lookup("sk-admin-0003").admin
    assert ring.lookup(None) is None and ring.lookup("") is None and ring.lookup("sk-admin-000") is None
    assert ring.lookup("sk-admin-0003 ") is None


def test_the_file_is_read_again_when_it_changes_and_a_missing_file_fails_closed(tmp_path):
    ring = _ring(tmp_path)
    assert ring.lookup("sk-new-0009") is None
    path = tmp_path / "keys"
    path.write_text(KEYS + "sk-new-0009 speech\n")
    assert ring.lookup("sk-new-0009") is not None  # no restart: the next lookup sees the change
    path.write_text("sk-new-0009 voices\n")
    os.utime(path, ns=(1, 1))  # a change is seen by mtime, size or inode, whichever moved
    assert ring.lookup("sk-new-0009").scopes == {"voices"} and ring.lookup("sk-admin-0003") is None
    path.unlink()
    assert ring.lookup("sk-new-0009") is None and len(ring) == 0
    path.write_text("sk-back-0010 speech\n")
    assert ring.lookup("sk-back-0010") is not None


def test_bearer_and_websocket_tokens():
    assert bearer_token([(b"authorization", b"Bearer  abc ")]) == "abc"
    assert bearer_token([(b"Authorization", b"bearer abc")]) == "abc"
    assert bearer_token([(b"authorization", b"Basic abc")]) is None and bearer_token([]) is None
    assert bearer_token([(b"authorization", b"Bearer")]) is None
    assert websocket_token({"headers": [], "query_string": b"x=1&api_key=k%2B1"}) == "k+1"
    assert websocket_token({"headers": [(b"authorization", b"Bearer h")], "query_string": b"api_key=q"}) == "h"


def _guarded_app(tmp_path, auth: AuthConfig | None) -> TestClient:
    app = FastAPI()
    app.add_middleware(AuthGuard, config=auth)

    @app.post("/v1/audio/speech")
    async def speech(request: Request):
        key = caller(request)
        return {"key": key.label if key else None}

    @app.get("/v1/models")
    async def models():
        return {"ok": True}

    @app.delete("/v1/audio/voices/{name}")
    async def delete(name: str):
        return {"deleted": name}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return TestClient(app)


def test_the_guard_answers_401_alike_for_missing_and_wrong_keys_and_403_without_the_scope(tmp_path):
    _ring(tmp_path)
    client = _guarded_app(tmp_path, AuthConfig(keys_file=str(tmp_path / "keys")))
    missing = client.post("/v1/audio/speech", json={})
    wrong = client.post("/v1/audio/speech", json={}, headers={"Authorization": "Bearer sk-nope"})
    assert missing.status_code == wrong.status_code == 401 and missing.json() == wrong.json()
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "authentication_error"
    with _Lines() as lines:
        ok = client.post("/v1/audio/speech", json={}, headers={"Authorization": "Bearer sk-speaker-0001"})
    label = key_digest("sk-speaker-0001").hex()[:8]
    assert ok.status_code == 200 and ok.json() == {"key": label}
    assert any(f"POST /v1/audio/speech 200 key={label}" in m for m in lines)  # the request's log line
    assert not any("sk-speaker" in m for m in lines)
    denied = client.delete("/v1/audio/voices/x", headers={"Authorization": "Bearer sk-speaker-0001"})
    assert denied.status_code == 403 and denied.json()["error"]["code"] == "insufficient_scope"
    assert client.delete("/v1/audio/voices/x", headers={"Authorization": "Bearer sk-uploader-0002"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-speaker-0001"}).status_code == 200
    assert client.get("/v1/models").status_code == 401
    assert client.get("/health").status_code == 200  # open


def test_without_a_keys_file_the_guard_lets_everyone_in(tmp_path):
    client = _guarded_app(tmp_path, AuthConfig())
    assert client.post("/v1/audio/speech", json={}).json() == {"key": None}
    assert Auth(AuthConfig()).check(None, "admin") is None


def test_the_keys_file_comes_from_the_environment_when_the_config_names_none(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN3_TTS_API_KEYS_FILE", str(tmp_path / "keys"))
    assert AuthConfig().keys_file == str(tmp_path / "keys")
    assert AuthConfig(keys_file="/other").keys_file == "/other"


def test_voice_ownership(tmp_path):
    ring = _ring(tmp_path)
    speaker, uploader, admin = (ring.lookup(k) for k in ("sk-speaker-0001", "sk-uploader-0002", "sk-admin-0003"))
    mine = uploader.id
    assert may_use(mine, uploader) and may_change(mine, uploader)
    assert not may_use(mine, speaker) and not may_change(mine, speaker)
    assert may_use(mine, admin) and may_change(mine, admin)
    assert may_use(None, speaker) and not may_change(None, speaker)  # uploaded while the server had no keys
    assert may_use(mine, None) and may_change(mine, None)  # keys off: everyone is trusted alike


def test_counters_limit_rate_and_streams_with_leases():
    now = [0.0]
    counters = Counters(clock=lambda: now[0])
    assert counters.admit("k", None, 3, False, 60) == (None, None, 0.0)
    lease, limit, _ = counters.admit("k", 1, 3, True, 60)
    assert lease and limit is None
    assert counters.admit("k", 1, 3, True, 60)[1] == KEY_STREAMS  # one stream open
    now[0] = 10.0
    _, limit, retry = counters.admit("k", None, 2, False, 60)  # 2 starts within the minute already
    assert limit == KEY_RATE and retry == pytest.approx(50.0)
    counters.release("k", lease)
    now[0] = 61.0
    assert counters.admit("k", 1, 3, True, 60)[1] is None
    now[0] = 200.0  # a lease never released expires with the deadline
    assert counters.counts("k") == {"streams": 0, "recent_starts": 0}


class _Remote:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def remote(self, *args):
        """Runs at the call, as an actor call is sent at once (its answer is awaited, or not)."""
        self.calls += 1
        answer = asyncio.get_running_loop().create_future()
        answer.set_result(self.fn(*args))
        return answer


def test_key_limits_refuse_locally_where_safe_and_ask_the_counters_otherwise(tmp_path):
    ring = _ring(tmp_path, "sk-a speech streams=1 rpm=2\nsk-free speech streams=0 rpm=0\n")
    key, free = ring.lookup("sk-a"), ring.lookup("sk-free")
    counters = Counters()
    actor = type("Actor", (), {})()
    actor.admit, actor.release = _Remote(counters.admit), _Remote(counters.release)
    limits = KeyLimits("app", lease_s=60)
    limits._actor = actor

    async def scenario():
        assert (await limits.admit(None, True)).lease is None and (await limits.admit(free, True)).lease is None
        assert actor.admit.calls == 0  # no key, or no limits: the actor is never asked
        first = await limits.admit(key, True)
        with pytest.raises(APIError) as streams:
            await limits.admit(key, True)  # this replica alone holds the key's one stream
        assert streams.value.status == 429 and streams.value.retry_after_s >= 1 and actor.admit.calls == 1
        first.release()
        first.release()  # idempotent
        await asyncio.sleep(0)
        assert counters.counts(key.id)["streams"] == 0
        await limits.admit(key, False)  # the second start of the minute
        with pytest.raises(APIError) as rate:
            await limits.admit(key, False)
        calls = actor.admit.calls
        with pytest.raises(APIError):
            await limits.admit(key, True)  # refused here until the Retry-After it got
        assert actor.admit.calls == calls and rate.value.retry_after_s > 1
        assert rate.value.limit == KEY_RATE and streams.value.limit == KEY_STREAMS and "sk-a" not in rate.value.message

    asyncio.run(scenario())
