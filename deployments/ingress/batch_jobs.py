"""`/v1/audio/speech/batches`: submit many speech requests as one job, follow it, fetch each item's audio.

    POST   /v1/audio/speech/batches                   {"requests": [<speech body>, ...]}, a JSONL body
                                                       (application/x-ndjson), or a multipart form whose `file`
                                                       is JSONL -> 202 {"id", "status", ...}
    GET    /v1/audio/speech/batches/{id}              status and progress
    GET    /v1/audio/speech/batches/{id}/items/{i}    item i's audio in its `response_format`; a failed item's
                                                       error (the status /v1/audio/speech would have answered);
                                                       409 `not_ready` (+ Retry-After) while it is queued or running
    DELETE /v1/audio/speech/batches/{id}              cancel what has not finished (finished items stay)

Every item is validated as `/v1/audio/speech` validates a request (fields, limits, model, voice, lengths)
before the job is accepted: one bad item refuses the job with a 400 naming its index. Items are synthesized by
the ingress replicas' batch workers (deployments/ingress/batch_worker.py) as low-priority Talker requests.
A store that cannot be written (disk full, storage unreachable) is a 503 and no job is created.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import ValidationError

from deployments.audio.formats import MEDIA_TYPES
from deployments.config import BatchSettings
from deployments.errors import APIError, bad_request, shown, to_api_error
from deployments.ingress.api_keys import ApiKey
from deployments.ingress.batch_store import BatchStore, StoreUnavailable
from deployments.ingress.batch_worker import BatchWorker
from deployments.ingress.schemas import SpeechRequest

JSONL_TYPES = ("application/x-ndjson", "application/jsonl", "application/x-jsonlines", "application/json-seq")
NOT_READY_RETRY_S = 1.0
# (body) -> raises the APIError /v1/audio/speech would answer for it (nothing is generated)
Validate = Callable[[SpeechRequest, ApiKey | None], Awaitable[None]]


class BatchJobs:
    """The batch API of one ingress replica over the shared store; `worker` is this replica's (told of new jobs,
    and of cancelled ones: its items stop at once, other replicas' at their next lease renewal)."""

    def __init__(self, store: BatchStore, settings: BatchSettings, validate: Validate, worker: BatchWorker,
                 default_format: str):
        """`default_format`: an item's `response_format` when it names none (stored with the item)."""
        self.store, self.settings, self._validate, self._worker = store, settings, validate, worker
        self._default_format = default_format

    async def submit(self, request: Request, key: ApiKey | None = None) -> JSONResponse:
        """`key`: the caller's API key (None: auth off); every item is checked as its own speech request would be."""
        raw = await _read_items(request)
        if not raw:
            raise bad_request("a batch needs at least one request", "requests", code="empty_batch")
        if len(raw) > self.settings.max_items:
            raise bad_request(f"a batch holds at most {self.settings.max_items} requests; this one has {len(raw)}",
                              "requests", code="too_many_requests")
        bodies = []
        for index, item in enumerate(raw):
            body = _parse(index, item).with_default_format(self._default_format)
            try:
                await self._validate(body, key)
            except Exception as exc:  # e.g. a model whose info cannot be had: its 503, naming the item
                raise _at(index, to_api_error(exc)) from None
            bodies.append(body.model_dump_json(exclude_unset=True))
        job = await self._store(self.store.create_job, bodies)
        self._worker.wake()
        return JSONResponse(job, status_code=202)

    async def status(self, batch_id: str) -> dict[str, Any]:
        return _found(batch_id, await self._store(self.store.describe, batch_id))

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        job = _found(batch_id, await self._store(self.store.cancel, batch_id))
        self._worker.stop_job(batch_id)
        return job

    async def item(self, batch_id: str, index: int):
        record = await self._store(self.store.item, batch_id, index) if index >= 0 else None
        if record is None:
            if await self._store(self.store.describe, batch_id, 0) is None:
                raise _no_job(batch_id)
            raise APIError(404, f"batch {batch_id} has no item {index}", param="index", code="not_found")
        if record.state == "completed":
            if not await asyncio.to_thread(record.path.is_file):
                raise APIError(404, f"the audio of item {index} of batch {batch_id} is gone", code="not_found")
            return FileResponse(record.path, media_type=MEDIA_TYPES[record.response_format],
                                filename=f"{batch_id}-{index}.{record.response_format}",
                                content_disposition_type="attachment")
        if record.state == "failed":
            error = dict(record.error or {})
            status = int(error.pop("status", 500))
            return JSONResponse({**error, "index": index, "state": "failed"}, status_code=status)
        if record.state == "cancelled":
            raise APIError(409, f"item {index} of batch {batch_id} was cancelled", code="cancelled")
        raise APIError(409, f"item {index} of batch {batch_id} is {record.state}; retry later", code="not_ready",
                       retry_after_s=NOT_READY_RETRY_S)

    async def _store(self, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except StoreUnavailable as exc:
            raise APIError(503, str(exc), code="store_unavailable", retry_after_s=NOT_READY_RETRY_S) from None


async def _read_items(request: Request) -> list[Any]:
    """The submitted request bodies, as parsed JSON values (each validated later)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media == "multipart/form-data":
        form = await request.form()
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise bad_request("the multipart form needs a `file` field holding the JSONL requests", "file")
        return _jsonl(await upload.read(), "file")
    data = await request.body()
    if media in JSONL_TYPES:
        return _jsonl(data, "body")
    try:
        document = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(document, dict) or set(document) != {"requests"} or not isinstance(document["requests"], list):
        raise bad_request('the body must be {"requests": [<speech request>, ...]} (or JSONL, one request a line, '
                          "sent as application/x-ndjson)", "requests")
    return document["requests"]


def _jsonl(data: bytes, param: str) -> list[Any]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"{param} is not UTF-8: {exc}", param) from None
    items = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise bad_request(f"line {number} of the JSONL (requests[{len(items)}]) is not valid JSON: {exc}",
                              f"requests[{len(items)}]", code="invalid_json") from None
    return items


def _parse(index: int, item: Any) -> SpeechRequest:
    if not isinstance(item, dict):
        raise bad_request(f"requests[{index}] must be a speech request object", f"requests[{index}]")
    try:
        body = SpeechRequest.model_validate(item)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        where = f"requests[{index}]" + (f".{loc}" if loc else "")
        raise bad_request(f"{where}: {first.get('msg', 'invalid value')}", where) from None
    if body.stream or body.stream_format is not None:
        where = f"requests[{index}].{'stream' if body.stream else 'stream_format'}"
        raise bad_request(f"{where}: a batch item is a file, it does not stream", where)
    if body.timestamps is not None:
        where = f"requests[{index}].timestamps"
        raise bad_request(f"{where}: a batch item's result is an audio file, without timestamps", where)
    return body


def _at(index: int, exc: APIError) -> APIError:
    """The error of item `index`, as the job's answer: its message and param name the item."""
    param = f"requests[{index}]" + (f".{exc.param}" if exc.param else "")
    status = 400 if exc.status == 404 else exc.status  # an unknown model or voice of an item: the job is bad
    return APIError(status, f"requests[{index}]: {exc.message}", param=param, code=exc.code,
                    retry_after_s=exc.retry_after_s, limit=exc.limit)


def _found(batch_id: str, job: dict | None) -> dict:
    if job is None:
        raise _no_job(batch_id)
    return job


def _no_job(batch_id: str) -> APIError:
    return APIError(404, f"no batch {shown(batch_id)}", param="batch_id", code="not_found")
