"""The server-sent events of a speech stream (`stream_format: sse`), OpenAI's `speech.audio.*` events:

    data: {"type": "speech.audio.delta", "audio": <base64 of the encoded chunk>}      one per chunk
    data: {"type": "speech.audio.done", "usage": {...}, "finish_reason": ...}         at the end
    data: {"type": "speech.audio.error", "error": {"message": ..., ...}}             instead, on a failure
"""

from __future__ import annotations

import base64
import json

from deployments.errors import APIError
from stages.contract import FinishReason

MEDIA_TYPE = "text/event-stream"


def event(kind: str, **fields) -> bytes:
    return f"data: {json.dumps({'type': f'speech.audio.{kind}', **fields})}\n\n".encode()


def delta(audio: bytes) -> bytes:
    return event("delta", audio=base64.b64encode(audio).decode())


def done(input_tokens: int, output_tokens: int, finish: FinishReason | None) -> bytes:
    usage = {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}
    return event("done", usage=usage, finish_reason=finish.value if finish else "unknown")


def error(error: APIError) -> bytes:
    return event("error", **error.body())
