"""Batch jobs without a cluster: the real API face, store (SQLite on disk) and worker, over a fake synthesizer
(the seam `TTSIngress` fills with its Talker path): lifecycle, bad items, cancel, restarts, leases, a full disk."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import sqlite3
import threading
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
import soundfile as sf
from fastapi import FastAPI, Request

from deployments.config import BatchSettings, IngressConfig
from deployments.errors import APIError, bad_request
from deployments.ingress import batch_store
from deployments.ingress.app import make_fastapi_app
from deployments.ingress.batch_jobs import BatchJobs
from deployments.ingress.batch_store import BatchStore, StoreUnavailable
from deployments.ingress.batch_worker import BatchWorker
from deployments.ingress.request_builder import check_limits
from deployments.ingress.schemas import SpeechRequest
from deployments.messages import DecodedChunk
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME, FinishReason

LIMITS = IngressConfig(max_input_chars=100)


class FakeSynth:
    """Each item's audio: `max_new_tokens` frames of a constant sample (its seed). Input "hold" waits for `gate`;
    input "busy" answers 503 (at capacity) `busy` times first; voice "broken" fails as the engine would."""

    def __init__(self):
        self.gate = asyncio.Event()
        self.started: list[str] = []  # request ids, in start order
        self.closed: list[str] = []  # request ids whose chunk stream was closed before its end
        self.busy = 1

    async def validate(self, body: SpeechRequest, key=None) -> None:
        check_limits(body, LIMITS)
        if body.voice == "nobody":
            raise bad_request("unknown voice 'nobody'", "voice", code="voice_not_found")

    async def __call__(self, body: SpeechRequest, request_id: str) -> AsyncIterator[DecodedChunk]:
        await self.validate(body)
        if body.input == "busy" and self.busy > 0:
            self.busy -= 1
            raise APIError(503, "the server is at capacity; retry later", code="overloaded", retry_after_s=0.01)
        self.started.append(request_id)
        return self._chunks(body, request_id)

    async def _chunks(self, body: SpeechRequest, request_id: str) -> AsyncIterator[DecodedChunk]:
        frames, ended = body.max_new_tokens or 3, False
        try:
            if body.voice == "broken":
                raise RuntimeError("engine failed")
            for seq in range(frames):
                if body.input == "hold":
                    await self.gate.wait()
                pcm = np.full(SAMPLES_PER_FRAME, body.seed or 0, dtype=np.int16)
                yield DecodedChunk(request_id, seq, pcm, seq == frames - 1, FinishReason.LENGTH if seq == frames - 1
                                   else None)
            ended = True
        finally:
            if not ended:
                self.closed.append(request_id)


def item(**fields) -> dict:
    return {"model": "cv", "input": "Hello.", "voice": "vivian", "max_new_tokens": 3, "seed": 5, **fields}


class Harness:
    """One "replica": a store over `root`, its worker, the batch routes on a FastAPI app, a client."""

    def __init__(self, root, synth: FakeSynth, owner: str = "a", **settings):
        self.settings = BatchSettings(store_dir=str(root), **{"lease_s": 30.0, "items_in_flight": 4, **settings})
        self.store = BatchStore(root, lease_s=self.settings.lease_s, max_attempts=self.settings.max_attempts)
        self.worker = BatchWorker(self.store, self.settings, synth, request_timeout_s=60, owner=owner)
        self.jobs = BatchJobs(self.store, self.settings, synth.validate, self.worker, "wav")
        app: FastAPI = make_fastapi_app(None)
        app.post("/b")(self._submit)
        app.get("/b/{batch_id}")(self.jobs.status)
        app.delete("/b/{batch_id}")(self.jobs.cancel)
        app.get("/b/{batch_id}/items/{index}")(self.jobs.item)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")

    async def _submit(self, request: Request):
        return await self.jobs.submit(request)

    def __enter__(self):
        self.worker.start()
        return self

    def __exit__(self, *exc):
        self.worker.close()

    async def status(self, job_id: str) -> dict:
        r = await self.client.get(f"/b/{job_id}")
        assert r.status_code == 200, r.text
        return r.json()

    async def until(self, job_id: str, predicate, timeout: float = 30) -> dict:
        async with asyncio.timeout(timeout):
            while not predicate(job := await self.status(job_id)):
                await asyncio.sleep(0.02)
        return job


async def until(predicate, timeout: float = 30):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def run(coro):
    return asyncio.run(coro)


def test_a_job_runs_to_completion_and_each_item_downloads_in_its_format(tmp_path):
    async def main():
        synth = FakeSynth()
        with Harness(tmp_path, synth) as h:
            bodies = [item(input="hold", seed=1), item(input="hold", seed=2, response_format="pcm", max_new_tokens=2),
                      item(seed=3, response_format="ulaw")]
            r = await h.client.post("/b", json={"requests": bodies})
            assert r.status_code == 202 and r.json()["status"] in ("queued", "running")
            job_id = r.json()["id"]
            job = await h.until(job_id, lambda j: j["completed"] == 1 and j["running"] == 2)
            assert job["status"] == "running" and job["total"] == 3 and job["created_at"] > 0
            not_ready = await h.client.get(f"/b/{job_id}/items/0")
            assert not_ready.status_code == 409 and not_ready.json()["error"]["code"] == "not_ready"
            assert not_ready.headers["retry-after"] == "1"
            synth.gate.set()
            job = await h.until(job_id, lambda j: j["status"] == "completed")
            assert (job["completed"], job["failed"], job["queued"], job["running"]) == (3, 0, 0, 0)
            assert job["ended_at"] is not None

            wav = await h.client.get(f"/b/{job_id}/items/0")
            assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
            audio, sr = sf.read(io.BytesIO(wav.content), dtype="int16")
            assert sr == SAMPLE_RATE and audio.shape == (3 * SAMPLES_PER_FRAME,) and set(audio) == {1}
            assert int.from_bytes(wav.content[40:44], "little") == 3 * SAMPLES_PER_FRAME * 2  # real sizes
            pcm = await h.client.get(f"/b/{job_id}/items/1")
            assert pcm.headers["content-type"] == "audio/pcm"
            assert np.array_equal(np.frombuffer(pcm.content, "<i2"), np.full(2 * SAMPLES_PER_FRAME, 2))
            mulaw = await h.client.get(f"/b/{job_id}/items/2")  # the alias is stored as its format
            assert mulaw.status_code == 200 and len(mulaw.content) > 0
            assert (await h.client.get(f"/b/{job_id}/items/3")).status_code == 404
            assert (await h.client.get("/b/batch_" + "0" * 32)).status_code == 404
            assert (await h.client.get("/b/../etc")).status_code == 404
            assert not list(tmp_path.glob("results/*/.*.tmp"))  # no temporary file left behind

    run(main())


def test_jsonl_bodies_and_uploads_are_accepted(tmp_path):
    async def main():
        with Harness(tmp_path, FakeSynth()) as h:
            lines = "\n".join(json.dumps(item(seed=i)) for i in range(2)) + "\n\n"
            r = await h.client.post("/b", content=lines, headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 202 and r.json()["total"] == 2
            r = await h.client.post("/b", files={"file": ("jobs.jsonl", lines.encode(), "application/jsonl")})
            assert r.status_code == 202 and r.json()["total"] == 2
            await h.until(r.json()["id"], lambda j: j["status"] == "completed")

    run(main())


@pytest.mark.parametrize(("body", "param"), [
    ({"requests": [item(), item(speed=9)]}, "requests[1].speed"),
    ({"requests": [item(), item(), item(voice="nobody")]}, "requests[2].voice"),
    ({"requests": [item(input="x" * 101)]}, "requests[0].input"),
    ({"requests": [item(stream=True)]}, "requests[0].stream"),
    ({"requests": [item(), item(timestamps="word")]}, "requests[1].timestamps"),
    ({"requests": [item(), "text"]}, "requests[1]"),
    ({"requests": []}, "requests"),
    ({"items": [item()]}, "requests"),
])
def test_a_bad_item_refuses_the_whole_job_naming_its_index(tmp_path, body, param):
    async def main():
        with Harness(tmp_path, FakeSynth()) as h:
            r = await h.client.post("/b", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param
            assert h.store.counts() == dict.fromkeys(batch_store.STATES, 0)  # no job was created

    run(main())


def test_a_bad_jsonl_line_names_its_index(tmp_path):
    async def main():
        with Harness(tmp_path, FakeSynth()) as h:
            lines = json.dumps(item()) + "\n{not json\n"
            r = await h.client.post("/b", content=lines, headers={"content-type": "application/x-ndjson"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "requests[1]"

    run(main())


def test_failed_items_keep_their_error_and_busy_items_wait_their_turn(tmp_path):
    async def main():
        synth = FakeSynth()
        with Harness(tmp_path, synth) as h:
            r = await h.client.post("/b", json={"requests": [item(voice="broken"), item(input="busy")]})
            job = await h.until(r.json()["id"], lambda j: j["status"] != "queued" and not j["queued"] + j["running"])
            assert job["status"] == "completed" and (job["completed"], job["failed"]) == (1, 1)
            assert job["errors"][0]["index"] == 0 and job["errors"][0]["error"]["code"] == "internal_error"
            failed = await h.client.get(f"/b/{job['id']}/items/0")
            assert failed.status_code == 500 and failed.json()["state"] == "failed"
            assert synth.busy == 0  # the 503 gave the item back; its second claim synthesized it

            r = await h.client.post("/b", json={"requests": [item(voice="broken")]})
            assert (await h.until(r.json()["id"], lambda j: j["failed"] == 1))["status"] == "failed"

    run(main())


def test_cancel_stops_running_items_and_drops_queued_ones(tmp_path):
    """Cancelled through another replica (`api`, whose worker has no items): the replica running them notices at its
    next lease renewal. (The replica that answers the cancel stops its own items at once: tests/serve.)"""
    async def main():
        synth = FakeSynth()
        api = Harness(tmp_path, FakeSynth(), owner="api")
        with Harness(tmp_path, synth, lease_s=0.3, items_in_flight=2) as h:
            r = await api.client.post("/b", json={"requests": [item(input="hold") for _ in range(4)]})
            assert r.status_code == 202, r.text
            h.worker.wake()
            job_id = r.json()["id"]
            await h.until(job_id, lambda j: j["running"] == 2)
            await until(lambda: len(synth.started) == 2)
            cancelled = await api.client.delete(f"/b/{job_id}")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            assert cancelled.json()["cancelled"] == 4
            await until(lambda: sorted(synth.closed) == sorted(synth.started))  # their Talker requests ended
            await until(lambda: h.worker.in_flight == 0)
            synth.gate.set()
            assert (await h.client.get(f"/b/{job_id}/items/3")).json()["error"]["code"] == "cancelled"
            assert (await h.status(job_id))["completed"] == 0 and len(synth.started) == 2
            assert not [p for p in tmp_path.glob("results/**/*") if p.is_file()]  # no partial file stays
            assert (await h.client.delete(f"/b/{job_id}")).json()["status"] == "cancelled"  # idempotent

    run(main())


def test_a_new_replica_resumes_a_job_its_stopped_predecessor_left(tmp_path):
    """Graceful stop (a redeploy): the items go back at once. Crash: they are taken again once their lease ran out."""
    async def main():
        first = FakeSynth()
        with Harness(tmp_path, first, owner="old") as old:
            r = await old.client.post("/b", json={"requests": [item(input="hold", seed=i) for i in range(6)]})
            job_id = r.json()["id"]
            await old.until(job_id, lambda j: j["running"] == 4)
        assert old.store.counts()["queued"] == 6  # given back on stop
        second = FakeSynth()
        second.gate.set()
        with Harness(tmp_path, second, owner="new") as new:  # a new store and worker over the same files
            job = await new.until(job_id, lambda j: j["status"] == "completed")
            assert job["completed"] == 6

        crashing = FakeSynth()
        crashed = Harness(tmp_path, crashing, owner="crashed", lease_s=0.5)
        crashed.worker.start()
        r = await crashed.client.post("/b", json={"requests": [item(input="hold", seed=i) for i in range(3)]})
        job_id = r.json()["id"]
        await crashed.until(job_id, lambda j: j["running"] == 3)
        crashed.worker._main.cancel()  # the replica dies: nothing is given back, no lease renewed
        for task in crashed.worker._tasks.values():
            task.cancel()
        await until(lambda: crashed.worker.in_flight == 0)
        assert crashed.store.counts()["running"] == 3
        resumed = FakeSynth()
        resumed.gate.set()
        with Harness(tmp_path, resumed, owner="next", lease_s=0.5) as new:
            job = await new.until(job_id, lambda j: j["status"] == "completed")
            assert job["completed"] == 3 and len(resumed.started) == 3

    run(main())


def test_two_replicas_on_one_store_never_run_the_same_item(tmp_path):
    async def main():
        a_synth, b_synth = FakeSynth(), FakeSynth()
        a_synth.gate.set()
        b_synth.gate.set()
        with Harness(tmp_path, a_synth, owner="a", items_in_flight=2) as a, \
                Harness(tmp_path, b_synth, owner="b", items_in_flight=2) as b:
            r = await a.client.post("/b", json={"requests": [item(input="hold", seed=i) for i in range(20)]})
            b.worker.wake()
            await a.until(r.json()["id"], lambda j: j["status"] == "completed")
            items = [s.split("-")[2] for s in a_synth.started + b_synth.started]
            assert sorted(items, key=int) == [str(i) for i in range(20)]  # each exactly once

    run(main())


def test_an_item_whose_replica_keeps_dying_fails_after_max_attempts(tmp_path):
    store = BatchStore(tmp_path, lease_s=0.0, max_attempts=2)  # every lease has run out at once
    job = store.create_job([json.dumps(item())])
    assert len(store.claim("a", 5)) == 1 and len(store.claim("b", 5)) == 1
    assert store.claim("c", 5) == []
    done = store.describe(job["id"])
    assert done["status"] == "failed" and done["errors"][0]["error"]["code"] == "attempts_exhausted"


class _FullDisk:
    """A file whose writes fail as on a full disk."""

    def __init__(self, file, failures: list):
        self._file, self._failures = file, failures

    def write(self, _data):
        self._failures.append("write")
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._file, name)


@pytest.mark.parametrize(("fault", "fmt"), [("fsync", "wav"), ("write", "wav"), ("write", "flac")])
def test_a_full_disk_reports_nothing_done_and_the_item_completes_once_there_is_room(tmp_path, monkeypatch, fault, fmt):
    async def main():
        synth = FakeSynth()
        with Harness(tmp_path, synth) as h:
            failures = []

            def full_disk(fd):
                failures.append(fd)
                raise OSError(errno.ENOSPC, "No space left on device")

            if fault == "fsync":
                monkeypatch.setattr(batch_store.os, "fsync", full_disk)
            else:
                real_init = batch_store.ResultFile.__init__

                def init(self, *args):
                    real_init(self, *args)
                    self._file = _FullDisk(self._file, failures)

                monkeypatch.setattr(batch_store.ResultFile, "__init__", init)
            r = await h.client.post("/b", json={"requests": [item(seed=4, response_format=fmt)]})
            job_id = r.json()["id"]
            await until(lambda: failures)
            await until(lambda: h.worker.in_flight == 0)
            job = await h.status(job_id)
            assert job["completed"] == 0 and job["status"] in ("queued", "running")
            assert (await h.client.get(f"/b/{job_id}/items/0")).status_code == 409
            assert not [p for p in tmp_path.glob("results/**/*") if p.is_file()]  # neither whole nor partial file
            assert h.store.describe(job_id)["failed"] == 0  # the item waits for room, it did not fail
            monkeypatch.undo()
            h.worker.wake()
            assert (await h.until(job_id, lambda j: j["status"] == "completed"))["completed"] == 1

    run(main())


def test_a_store_that_cannot_be_written_is_a_503_and_creates_nothing(tmp_path, monkeypatch):
    async def main():
        with Harness(tmp_path, FakeSynth()) as h:
            r = await h.client.post("/b", json={"requests": [item()]})
            job_id = r.json()["id"]
            await h.until(job_id, lambda j: j["status"] == "completed")

            def disk_full(*_args, **_kwargs):
                raise sqlite3.OperationalError("database or disk is full")

            h.store._db = _Failing(h.store._connect(), disk_full)  # the store opens a new connection after it
            r = await h.client.post("/b", json={"requests": [item(), item()]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
            assert "disk is full" in r.json()["error"]["message"] and "retry-after" in r.headers
            assert h.store.counts()["queued"] == 0 and h.store.counts()["completed"] == 1  # rolled back whole

            monkeypatch.setattr(h.store, "_connect", lambda: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
            assert (await h.client.get(f"/b/{job_id}")).status_code == 503

    run(main())


class _Failing:
    """A connection whose `executemany` fails (the insert of a job's items): everything else passes through."""

    def __init__(self, db, fail):
        self._db, self.executemany = db, fail

    def __getattr__(self, name):
        return getattr(self._db, name)


def test_jobs_past_their_retention_are_deleted_with_their_audio(tmp_path):
    async def main():
        with Harness(tmp_path, FakeSynth()) as h:
            r = await h.client.post("/b", json={"requests": [item()]})
            job_id = r.json()["id"]
            await h.until(job_id, lambda j: j["status"] == "completed")
            assert (tmp_path / "results" / job_id).is_dir()
            assert h.store.expire(retention_s=3600) == 0
            assert h.store.expire(retention_s=0) == 1
            assert not (tmp_path / "results" / job_id).exists()
            assert (await h.client.get(f"/b/{job_id}")).status_code == 404

    run(main())


def test_store_errors_name_a_full_disk():
    assert "disk is full" in str(StoreUnavailable(batch_store._describe(OSError(errno.ENOSPC, "x"))))


def test_replicas_opening_a_new_store_together_all_get_in(tmp_path):
    """Two replicas' first calls on a new store race to switch it to WAL; SQLite answers the loser "locked" at once,
    without its busy handler. Neither call may fail."""
    for attempt in range(40):
        root = tmp_path / str(attempt)
        stores = [BatchStore(root), BatchStore(root, lease_s=0.3)]
        start, errors = threading.Barrier(2), []

        def first_call(store: BatchStore, create: bool, start=start, errors=errors):
            start.wait()
            try:
                store.create_job([json.dumps(item())]) if create else store.counts()
            except StoreUnavailable as exc:
                errors.append(exc)

        threads = [threading.Thread(target=first_call, args=(s, i == 0)) for i, s in enumerate(stores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert stores[1].counts()["queued"] == 1
        for s in stores:
            s.close()
