"""The ingress: the app's OpenAI-compatible HTTP API (FastAPI on Ray Serve, CPU only) and everything that runs in
an ingress replica, one concern a file.

    app.py             the FastAPI app (body guard, OpenAPI document as the server answers, error handlers),
                       `ENDPOINTS` (method, path -> server method) and `make_fastapi_ingress`
    server.py          `TTSIngress`, a plain class: one method per endpoint; speech requests admitted and started
    routing.py         served models by name and alias, their `ModelInfo`s; /health and /ready
    speech.py          the speech writers: the whole body, or a stream of raw bytes / SSE events
    voices.py          the clone prompt a request uses; list, upload and delete uploaded voices (disk in threads)
    voice_store.py     `VoiceStore`: uploaded voices on disk
    live.py            `/v1/audio/speech/stream`: the WebSocket session of live-text contexts
    live_pieces.py     `LivePieces`: a context's text as consecutive live Talker requests, one stream of audio
    talker_calls.py    `TalkerCalls`: the replica's Talker requests (speech and live) batched into few streaming calls
    websocket_deflate.py  the WebSocket declines per-message compression (audio frames deflated on the loop)
    outcomes.py        a failure -> the client's JSON error; request metrics; `PlaybackClock` (a client's buffer)
    request_builder.py limits, model and voice choice, the engine's `SynthesisRequest` (fitted to max_seq_len)
    ref_audio.py       reference clips: fetched, probed, decoded (uploads and inline `ref_audio`)
    schemas.py         the request bodies (pydantic)
    voice_aliases.py   OpenAI's voice and model names -> CustomVoice speakers and the served default model
    api_keys.py        `KeyRing`: the keys file (scopes, per-key limits), read again when it changes
    auth.py            `AuthGuard` (keys on HTTP: 401/403), WebSocket tokens, who may use or change a voice
    rate_limits.py     per-key streams and requests per minute, counted across replicas in a named actor
    http_guard.py      `BodyGuard` (bodies in whole, within a deadline) and `OpenWork` (the replica's admission)
    pipeline.py        one request's stream: Talker chunks -> DecodeBatcher -> decoded audio, in order
    decode_batcher.py  `DecodeBatcher`: every stream's chunks to Code2Wav in few calls
    placement.py       `StreamPlacement`: which Code2Wav replica holds each stream's state (stream affinity)
    batch_jobs.py      `/v1/audio/speech/batches`: submit (JSON or JSONL, every item validated), status, items, cancel
    batch_store.py     `BatchStore`: jobs and items in SQLite (leases), items' audio written whole or not at all
    batch_worker.py    `BatchWorker`: a replica's share of the items, synthesized at batch priority onto disk
    batch_cli.py       `python -m deployments.ingress.batch_cli FILE.jsonl OUTDIR --url ...` (the client side)

`deployments.builder.build_app` deploys `make_fastapi_ingress(TTSIngress, app=make_fastapi_app(...))`.
"""

from deployments.ingress.app import ENDPOINTS, make_fastapi_app, make_fastapi_ingress
from deployments.ingress.server import TTSIngress

__all__ = ["ENDPOINTS", "TTSIngress", "make_fastapi_app", "make_fastapi_ingress"]
