"""Batch jobs' durable state: a SQLite database and, beside it, each finished item's audio file.

Layout under `ingress.batch.store_dir` (default <serve home>/batches):

    jobs.sqlite3                  jobs and their items (state, lease, error, result file)
    results/<job id>/<i>.<ext>    item i's audio, fsynced and renamed into place: a file here is whole

An item is `queued`, `running` (claimed: a replica holds its lease), `completed`, `failed` or `cancelled`.
Claims happen in one write transaction (`BEGIN IMMEDIATE`), so two replicas sharing the database never claim the
same item; a replica renews its leases while it works, and an item whose lease ran out (its replica died) is
claimed again, at most `max_attempts` times. An item is reported `completed` only after its file is whole on disk
and the claim that wrote it still holds. Every failure to read or write the database or the results directory
(disk full, storage unreachable, a lock not granted in time) is a `StoreUnavailable`: the API answers 503 and
nothing it did stays half-done (a transaction rolls back; a result file is renamed into place or removed).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from deployments import constants as C

T = TypeVar("T")
JOB_ID = re.compile(r"^batch_[0-9a-f]{32}$")
STATES = ("queued", "running", "completed", "failed", "cancelled")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, created_at REAL NOT NULL, total INTEGER NOT NULL,
    ended_at REAL, cancelled_at REAL);
CREATE TABLE IF NOT EXISTS items (
    job_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL,
    owner TEXT, lease_until REAL, attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT, result TEXT, bytes INTEGER, ended_at REAL,
    PRIMARY KEY (job_id, idx));
CREATE INDEX IF NOT EXISTS items_by_state ON items (state);
"""


class StoreUnavailable(Exception):
    """The store cannot be read or written now (disk full, storage unreachable, locked beyond the busy timeout)."""


@dataclass(frozen=True)
class Claim:
    """An item this replica holds the lease of."""

    job_id: str
    index: int
    body: str  # the item's request body (JSON), as submitted

    @property
    def key(self) -> tuple[str, int]:
        return self.job_id, self.index


@dataclass(frozen=True)
class ItemRecord:
    state: str
    error: dict | None  # a failed item: {"status": ..., "error": {...}}
    path: Path | None  # a completed item: its audio
    response_format: str


class BatchStore:
    """One process's handle on the store; methods are blocking (the ingress calls them in a thread)."""

    def __init__(self, root: str | Path, journal_mode: str = "wal", lease_s: float = C.DEFAULT_BATCH_LEASE_S,
                 max_attempts: int = 3, busy_timeout_s: float = C.BATCH_STORE_BUSY_TIMEOUT_S):
        self.root = Path(root).expanduser()
        self.results = self.root / "results"
        self.journal_mode, self.lease_s, self.max_attempts = journal_mode, lease_s, max_attempts
        self._busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self._db: sqlite3.Connection | None = None  # opened on first use: an unreachable store is a 503, not a crash

    # ------------------------------------------------------------------ connection
    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            self.results.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.root / "jobs.sqlite3", timeout=self._busy_timeout_s, isolation_level=None,
                                 check_same_thread=False)
            try:
                self._set_up(db)
            except BaseException:
                db.close()
                raise
            self._db = db
        return self._db

    def _set_up(self, db: sqlite3.Connection) -> None:
        """Journal mode and schema. SQLite answers "locked" at once, without its busy handler, when two replicas
        switch a new store to WAL together: retried here up to the busy timeout, as any other lock wait is."""
        deadline, pause = time.monotonic() + self._busy_timeout_s, 0.005
        while True:
            try:
                db.execute(f"PRAGMA journal_mode={self.journal_mode}")
                db.execute("PRAGMA synchronous=FULL")  # a committed claim or result survives a power loss
                db.executescript(_SCHEMA)
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() + pause > deadline:
                    raise
                time.sleep(pause)
                pause = min(pause * 2, 0.2)

    def _run(self, fn: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        with self._lock:
            try:
                db = self._connect()
                if not write:
                    return fn(db)
                db.execute("BEGIN IMMEDIATE")  # the write lock now: claims of two replicas never interleave
                try:
                    result = fn(db)
                    db.execute("COMMIT")
                    return result
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except (sqlite3.Error, OSError) as exc:
                self._reset_if_broken(exc)
                raise StoreUnavailable(_describe(exc)) from exc

    def _reset_if_broken(self, exc: BaseException) -> None:
        """After an I/O failure the connection may be unusable; the next call opens a new one."""
        if isinstance(exc, OSError) or (isinstance(exc, sqlite3.OperationalError) and "locked" not in str(exc)):
            if self._db is not None:
                try:
                    self._db.close()
                except sqlite3.Error:
                    pass
                self._db = None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    # ------------------------------------------------------------------ jobs
    def create_job(self, bodies: list[str]) -> dict[str, Any]:
        """A new job of `bodies` (validated request bodies, JSON), all its items queued; -> its description."""
        job_id, now = f"batch_{uuid.uuid4().hex}", time.time()

        def insert(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO jobs (id, created_at, total) VALUES (?, ?, ?)", (job_id, now, len(bodies)))
            db.executemany("INSERT INTO items (job_id, idx, body, state) VALUES (?, ?, ?, 'queued')",
                           ((job_id, i, body) for i, body in enumerate(bodies)))

        self._run(insert, write=True)
        return self.describe(job_id)

    def describe(self, job_id: str, max_errors: int = 100) -> dict[str, Any] | None:
        """A job's status and progress (None: no such job); its first `max_errors` failed items with their error."""
        if not JOB_ID.match(job_id):
            return None

        def read(db: sqlite3.Connection):
            job = db.execute("SELECT created_at, total, ended_at, cancelled_at FROM jobs WHERE id = ?",
                             (job_id,)).fetchone()
            if job is None:
                return None
            counts = dict(db.execute("SELECT state, COUNT(*) FROM items WHERE job_id = ? GROUP BY state", (job_id,)))
            errors = db.execute("SELECT idx, error FROM items WHERE job_id = ? AND state = 'failed' ORDER BY idx "
                                "LIMIT ?", (job_id, max_errors)).fetchall()
            return job, counts, errors

        found = self._run(read)
        if found is None:
            return None
        (created_at, total, ended_at, cancelled_at), counts, errors = found
        return {
            "id": job_id, "object": "speech.batch", "status": _job_status(total, counts, cancelled_at),
            "total": total, **{state: counts.get(state, 0) for state in STATES},
            "created_at": int(created_at), "ended_at": _int_or_none(ended_at),
            "cancelled_at": _int_or_none(cancelled_at),
            "errors": [{"index": i, **json.loads(e)} for i, e in errors],
        }

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Cancel a job's items not yet finished (those running stop at their replica's next lease renewal);
        finished items stay downloadable. None: no such job."""
        if not JOB_ID.match(job_id):
            return None
        now = time.time()

        def cancel(db: sqlite3.Connection) -> bool:
            if db.execute("SELECT 1 FROM jobs WHERE id = ?", (job_id,)).fetchone() is None:
                return False
            db.execute("UPDATE items SET state = 'cancelled', owner = NULL, lease_until = NULL, ended_at = ? "
                       "WHERE job_id = ? AND state IN ('queued', 'running')", (now, job_id))
            db.execute("UPDATE jobs SET cancelled_at = ?, ended_at = COALESCE(ended_at, ?) "
                       "WHERE id = ? AND cancelled_at IS NULL AND ended_at IS NULL", (now, now, job_id))
            return True

        return self.describe(job_id) if self._run(cancel, write=True) else None

    def item(self, job_id: str, index: int) -> ItemRecord | None:
        if not JOB_ID.match(job_id):
            return None
        row = self._run(lambda db: db.execute("SELECT state, error, result, body FROM items WHERE job_id = ? AND "
                                              "idx = ?", (job_id, index)).fetchone())
        if row is None:
            return None
        state, error, result, body = row
        return ItemRecord(state, json.loads(error) if error else None,
                          self.results / job_id / result if result else None, response_format_of(body))

    def counts(self) -> dict[str, int]:
        """Items of every job by state (the progress gauge)."""
        found = dict(self._run(lambda db: db.execute("SELECT state, COUNT(*) FROM items GROUP BY state").fetchall()))
        return {state: found.get(state, 0) for state in STATES}

    # ------------------------------------------------------------------ work
    def claim(self, owner: str, limit: int) -> list[Claim]:
        """Up to `limit` items for `owner`, oldest job first: queued ones, and running ones whose lease ran out
        (an item whose replica died `max_attempts` times fails instead)."""
        now = time.time()

        def claim(db: sqlite3.Connection) -> list[Claim]:
            expired = db.execute("SELECT job_id, idx, attempts FROM items WHERE state = 'running' AND "
                                 "lease_until < ?", (now,)).fetchall()
            for job_id, idx, attempts in expired:
                if attempts >= self.max_attempts:
                    error = _error_json(500, f"the item was claimed {attempts} times and its replica stopped each "
                                        "time", "attempts_exhausted")
                    self._end(db, job_id, idx, "failed", now, error=error)
            rows = db.execute("SELECT job_id, idx, body FROM items WHERE state = 'queued' OR (state = 'running' "
                              "AND lease_until < ?) ORDER BY rowid LIMIT ?", (now, limit)).fetchall()
            db.executemany("UPDATE items SET state = 'running', owner = ?, lease_until = ?, attempts = attempts + 1 "
                           "WHERE job_id = ? AND idx = ?", ((owner, now + self.lease_s, j, i) for j, i, _ in rows))
            return [Claim(j, i, body) for j, i, body in rows]

        return self._run(claim, write=True)

    def renew(self, owner: str, keys: list[tuple[str, int]]) -> set[tuple[str, int]]:
        """Extend `owner`'s leases on `keys`; -> those it still holds (a cancelled item's is gone)."""
        until = time.time() + self.lease_s

        def renew(db: sqlite3.Connection) -> set[tuple[str, int]]:
            held = set()
            for job_id, idx in keys:
                cur = db.execute("UPDATE items SET lease_until = ? WHERE job_id = ? AND idx = ? AND owner = ? AND "
                                 "state = 'running'", (until, job_id, idx, owner))
                if cur.rowcount:
                    held.add((job_id, idx))
            return held

        return self._run(renew, write=True)

    def complete(self, owner: str, claim: Claim, result_name: str, nbytes: int) -> bool:
        """Report an item done, its file already in place; False when the claim no longer holds (cancelled, or
        its lease ran out and another replica took it)."""
        return self._finish(owner, claim, "completed", result=result_name, nbytes=nbytes)

    def fail(self, owner: str, claim: Claim, status: int, body: dict) -> bool:
        return self._finish(owner, claim, "failed", error=json.dumps({"status": status, **body}))

    def release(self, owner: str, keys: list[tuple[str, int]] | None = None) -> None:
        """Give claimed items back to the queue, not counting the attempt (a replica stopping, a full disk)."""
        def release(db: sqlite3.Connection) -> None:
            sql = ("UPDATE items SET state = 'queued', owner = NULL, lease_until = NULL, attempts = attempts - 1 "
                   "WHERE owner = ? AND state = 'running'")
            if keys is None:
                db.execute(sql, (owner,))
            else:
                db.executemany(sql + " AND job_id = ? AND idx = ?", ((owner, j, i) for j, i in keys))

        self._run(release, write=True)

    def _finish(self, owner: str, claim: Claim, state: str, **fields) -> bool:
        now = time.time()

        def finish(db: sqlite3.Connection) -> bool:
            held = db.execute("SELECT 1 FROM items WHERE job_id = ? AND idx = ? AND owner = ? AND state = 'running'",
                              (claim.job_id, claim.index, owner)).fetchone()
            if held is None:
                return False
            self._end(db, claim.job_id, claim.index, state, now, **fields)
            return True

        return self._run(finish, write=True)

    @staticmethod
    def _end(db: sqlite3.Connection, job_id: str, idx: int, state: str, now: float, error: str | None = None,
             result: str | None = None, nbytes: int | None = None) -> None:
        db.execute("UPDATE items SET state = ?, owner = NULL, lease_until = NULL, error = ?, result = ?, bytes = ?, "
                   "ended_at = ? WHERE job_id = ? AND idx = ?", (state, error, result, nbytes, now, job_id, idx))
        open_items = db.execute("SELECT COUNT(*) FROM items WHERE job_id = ? AND state IN ('queued', 'running')",
                                (job_id,)).fetchone()[0]
        if not open_items:
            db.execute("UPDATE jobs SET ended_at = ? WHERE id = ? AND ended_at IS NULL", (now, job_id))

    # ------------------------------------------------------------------ results and retention
    @contextmanager
    def result_file(self, claim: Claim, ext: str) -> Iterator[ResultFile]:
        """A file for an item's audio, in place under its final name only by `ResultFile.commit`."""
        directory = self.results / claim.job_id
        try:
            directory.mkdir(parents=True, exist_ok=True)
            file = ResultFile(directory, f"{claim.index}.{ext}")
        except OSError as exc:
            raise StoreUnavailable(_describe(exc)) from exc
        try:
            yield file
        finally:
            file.discard()

    def expire(self, retention_s: float) -> int:
        """Delete jobs (rows and audio) that ended more than `retention_s` ago; -> how many."""
        cutoff = time.time() - retention_s

        def expire(db: sqlite3.Connection) -> list[str]:
            ids = [r[0] for r in db.execute("SELECT id FROM jobs WHERE ended_at < ?", (cutoff,))]
            for job_id in ids:
                db.execute("DELETE FROM items WHERE job_id = ?", (job_id,))
                db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            return ids

        ids = self._run(expire, write=True)
        for job_id in ids:  # after the commit: the rows go first, a job's audio is only ever found through them
            shutil.rmtree(self.results / job_id, ignore_errors=True)
        return len(ids)


class ResultFile:
    """An item's audio written to a temporary name, then fsynced and renamed: readers never see part of it.

    A seekable binary file for the encoder (deployments/audio/encoders.FileEncoder). A write that fails (disk full)
    is kept in `failure`: whatever an encoder makes of the OSError, the writer sees what happened."""

    def __init__(self, directory: Path, name: str):
        self.directory, self.name = directory, name
        self._tmp = directory / f".{name}.{uuid.uuid4().hex}.tmp"
        self._file = open(self._tmp, "wb")  # closed by commit or discard
        self.failure: StoreUnavailable | None = None
        self.size = 0  # bytes, once committed

    def write(self, data: bytes) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.failure = StoreUnavailable(_describe(exc))
            raise self.failure from exc

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def seekable(self) -> bool:
        return True

    def commit(self) -> Path:
        """Flush, fsync, rename into place and fsync the directory: the file is whole, and stays so."""
        final = self.directory / self.name
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self.size = os.fstat(self._file.fileno()).st_size
            self._file.close()
            os.replace(self._tmp, final)
            fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StoreUnavailable(_describe(exc)) from exc
        return final

    def discard(self) -> None:
        """Remove the temporary file (nothing once committed)."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def response_format_of(body: str) -> str:
    from deployments.ingress.schemas import SpeechRequest

    return SpeechRequest.model_validate_json(body).response_format


def _job_status(total: int, counts: dict[str, int], cancelled_at: float | None) -> str:
    if cancelled_at is not None:
        return "cancelled"
    done, failed = counts.get("completed", 0), counts.get("failed", 0)
    if done + failed == total:
        return "failed" if failed == total else "completed"
    return "running" if done or failed or counts.get("running") else "queued"


def _error_json(status: int, message: str, code: str) -> str:
    from deployments.errors import APIError

    return json.dumps({"status": status, **APIError(status, message, code=code).body()})


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _describe(exc: BaseException) -> str:
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "disk is full" in str(exc):
        return "the batch store's disk is full"
    return f"the batch store is unavailable ({type(exc).__name__}: {exc})"
