"""API keys: the keys file, read again whenever it changes, and the lookup of a presented key.

The file (`ingress.auth.keys_file`, or env QWEN3_TTS_API_KEYS_FILE) holds one key a line:

    # comment
    sk-team-a-0123456789abcdef   speech,voices
    sk-ops-fedcba9876543210      admin              streams=64 rpm=0
    sk-kiosk-00aa11bb22cc33dd    speech             streams=2 rpm=30

Scopes (comma-separated): `speech` (POST /v1/audio/speech, the WebSocket), `voices` (upload and delete one's own
voices), `admin` (everything, every key's voices). Optional `streams=N` and `rpm=N` override the per-key limits
of `ingress.auth` (0: no limit). A line that does not parse is skipped with a warning naming its line number
(never its text: it holds a key). A configured file that cannot be read leaves no key valid: every request is a
401 until it can be (fail closed).

Only a key's sha256 is kept past parsing: `ApiKey.id` (the owner of the voices it uploads) and `ApiKey.label`
(its first 8 hex digits: the metric label and the log's `key=`). Lookups compare the presented key's digest
with every key's by `hmac.compare_digest`, in constant time per key and without an early exit.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from deployments.config import AuthConfig

logger = logging.getLogger("ray.serve")

SPEECH, VOICES, ADMIN = "speech", "voices", "admin"
SCOPES = frozenset((SPEECH, VOICES, ADMIN))
_LIMIT_FIELDS = {"streams": "max_concurrent_streams", "rpm": "requests_per_minute"}


@dataclass(frozen=True)
class ApiKey:
    id: str  # sha256 of the key, hex
    scopes: frozenset[str]
    max_concurrent_streams: int | None  # None: no limit
    requests_per_minute: int | None

    @property
    def label(self) -> str:
        """The key's name in metrics and logs: a hash prefix, never the key."""
        return self.id[:8]

    @property
    def admin(self) -> bool:
        return ADMIN in self.scopes

    def allows(self, scope: str) -> bool:
        return self.admin or scope in self.scopes


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_keys(text: str, defaults: AuthConfig, source: str = "keys file") -> dict[bytes, ApiKey]:
    """digest -> ApiKey for every valid line of `text`."""
    keys: dict[bytes, ApiKey] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            digest, key = _parse_line(line, defaults)
        except ValueError as e:
            logger.warning(f"{source}, line {number}: {e}; the line is skipped")
            continue
        keys[digest] = key
    return keys


def _parse_line(line: str, defaults: AuthConfig) -> tuple[bytes, ApiKey]:
    fields = line.split()
    if len(fields) < 2:
        raise ValueError("expected `KEY SCOPES [streams=N] [rpm=N]`")
    secret, scopes_field, options = fields[0], fields[1], fields[2:]
    scopes = frozenset(s.strip().lower() for s in scopes_field.split(",") if s.strip())
    if not scopes or scopes - SCOPES:
        raise ValueError(f"scopes must be a comma-separated subset of {sorted(SCOPES)}")
    limits = {"max_concurrent_streams": defaults.max_concurrent_streams,
              "requests_per_minute": defaults.requests_per_minute}
    for option in options:
        name, _, value = option.partition("=")
        if name not in _LIMIT_FIELDS or not value.isdigit():
            raise ValueError(f"options are {sorted(_LIMIT_FIELDS)}=N (N >= 0, 0: no limit)")
        limits[_LIMIT_FIELDS[name]] = int(value) or None
    digest = key_digest(secret)
    return digest, ApiKey(id=digest.hex(), scopes=scopes, **limits)


class KeyRing:
    """The keys of one keys file, read again when its modification time (or size, or inode) changes."""

    def __init__(self, path: str | Path, defaults: AuthConfig):
        self.path, self._defaults = Path(path).expanduser(), defaults
        self._lock = threading.Lock()  # lookups come from the event loop and from threads
        self._stamp: tuple[int, int, int] | None = None
        self._keys: dict[bytes, ApiKey] = {}
        self._failed = False

    def lookup(self, presented: str | None) -> ApiKey | None:
        """The key `presented` is, or None (missing or wrong: the caller cannot tell which from the answer)."""
        keys = self._current()
        if not presented:
            return None
        digest, found = key_digest(presented), None
        for known, key in keys.items():  # every key compared: no early exit
            if hmac.compare_digest(digest, known):
                found = key
        return found

    def __len__(self) -> int:
        return len(self._current())

    def _current(self) -> dict[bytes, ApiKey]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError as e:
            with self._lock:
                if not self._failed:
                    logger.error(f"API keys file {self.path} cannot be read ({type(e).__name__}): no key is valid "
                                 "until it can be")
                self._failed, self._keys, self._stamp = True, {}, None
                return self._keys
        if stamp == self._stamp:
            return self._keys
        with self._lock:
            if stamp != self._stamp:
                try:
                    text = self.path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as e:
                    logger.error(f"API keys file {self.path} cannot be read ({type(e).__name__}): no key is valid")
                    self._keys, self._stamp, self._failed = {}, None, True
                    return self._keys
                self._keys = parse_keys(text, self._defaults, str(self.path))
                self._stamp, self._failed = stamp, False
                logger.info(f"API keys file {self.path}: {len(self._keys)} keys loaded")
            return self._keys


_RINGS: dict[tuple[str, AuthConfig], KeyRing] = {}


def key_ring(config: AuthConfig) -> KeyRing | None:
    """This process's KeyRing of `config`'s keys file (one per file: the HTTP guard and the WebSocket share it);
    None when auth is off."""
    if not config.keys_file:
        return None
    ring = _RINGS.get((config.keys_file, config))
    if ring is None:
        ring = _RINGS[(config.keys_file, config)] = KeyRing(config.keys_file, config)
    return ring
