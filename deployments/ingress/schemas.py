"""HTTP request bodies: OpenAI's `/v1/audio/speech` fields plus the Qwen3-TTS extensions.

Every number is bounded here, at the API edge: integers end up in int64 tensors on the engine thread,
where an out-of-range value (e.g. top_k = 2**63) used to raise inside the engine and take every stream
of the replica down with it. Strings must be valid Unicode (a lone UTF-16 surrogate is a 400, not a
tokenizer crash), and NaN/infinity are refused.
"""

from __future__ import annotations

import contextlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from deployments.errors import APIError, bad_request

# every format streams (deployments/audio/encoders.py); mulaw / alaw are G.711 at 8 kHz for telephony
ResponseFormat = Literal["wav", "pcm", "flac", "mp3", "opus", "aac", "mulaw", "alaw"]
FORMAT_ALIASES = {"ulaw": "mulaw", "g711_ulaw": "mulaw", "g711_alaw": "alaw"}  # OpenAI Realtime's names
# bounds of the numeric fields (the model-specific limits, e.g. max_seq_len, are checked later per model)
MAX_TOP_K = 4096  # >= every 12 Hz vocabulary (talker 3072 ids, code predictor 2048); 0 disables top-k
MAX_FRAMES = 65536  # 87 minutes of audio: above any engine's max_seq_len
MAX_SEED = 2**63 - 1  # int64
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TIMEOUT_S = 86400.0
MAX_NAME_CHARS = 256  # model, voice, language: longer is never a real name

SAMPLING_FIELDS = (
    "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "subtalker_do_sample",
    "subtalker_temperature", "subtalker_top_k", "subtalker_top_p", "min_frames", "suppress_eos",
)


class SpeechRequest(BaseModel):
    """`POST /v1/audio/speech`. Unknown fields are rejected (a typo must not be silently ignored)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    # OpenAI
    model: str | None = Field(None, max_length=MAX_NAME_CHARS,
                              description="served model name; may be omitted when the request is unambiguous")
    input: str = Field(description="text to speak")
    voice: str | None = Field(None, max_length=MAX_NAME_CHARS,
                              description="preset speaker (CustomVoice) or uploaded voice (Base)")
    response_format: ResponseFormat | None = Field(None, description="default: `ingress.default_response_format` "
                                                   "(mp3, as OpenAI's)")
    speed: float = Field(1.0, ge=0.25, le=4.0, description="tempo, pitch preserved (streamed or not)")
    instructions: str | None = Field(None, description="style instruction (CustomVoice 1.7B) or voice description "
                                     "(VoiceDesign)")
    stream: bool | None = Field(None, description="stream the audio as it is generated (the default); false: one "
                                "body, sent when it is complete")
    stream_format: Literal["audio", "sse"] | None = Field(None, description="audio = raw chunked bytes, "
                                                          "sse = base64 `speech.audio.delta` events")
    # Qwen3-TTS
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: str | None = Field(None, max_length=MAX_NAME_CHARS,
                                 description="'auto' (default) or a language of the checkpoint")
    ref_audio: str | None = Field(None, description="reference clip: base64, a data: URI, or an allowlisted URL")
    ref_text: str | None = Field(None, description="transcript of ref_audio (in-context cloning)")
    x_vector_only_mode: bool = Field(False, description="clone from the speaker embedding only (no transcript)")
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_FRAMES, description="codec frames at most (80 ms each)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    initial_codec_chunk_frames: int | None = Field(None, ge=1, le=MAX_FRAMES,
                                                   description="frames of the first streamed chunk")
    timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S,
                                    description="deadline of this request (capped by the server's)")
    timestamps: Literal["word", "char"] | None = Field(None, description=(
        "word (or character) times with the audio: SSE `speech.audio.timestamps` events (a stream with timestamps is "
        "SSE), or a JSON body with `stream: false`; needs the server's aligner (docs/aligner.md)"))
    # sampling (defaults: the checkpoint's generation_config.json)
    do_sample: bool | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    top_p: float | None = Field(None, gt=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    subtalker_do_sample: bool | None = None
    subtalker_temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    subtalker_top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    subtalker_top_p: float | None = Field(None, gt=0, le=1)
    min_frames: int | None = Field(None, ge=0, le=MAX_FRAMES)
    suppress_eos: bool | None = Field(None, description="never stop before max_new_tokens (benchmarks, tests)")

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_object(cls, value: Any) -> Any:
        """OpenAI also accepts `{"id": "voice_1234"}`."""
        if isinstance(value, dict):
            if set(value) != {"id"} or not isinstance(value["id"], str):
                raise ValueError("voice must be a string or an object {'id': str}")
            return value["id"]
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return check_unicode(value)

    @field_validator("response_format", mode="before")
    @classmethod
    def _format_alias(cls, value: Any) -> Any:
        return FORMAT_ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _streaming_mode(self) -> SpeechRequest:
        if self.stream is False and self.stream_format == "sse":
            raise ValueError("stream_format 'sse' streams; it cannot be combined with stream: false")
        if self.timestamps is not None and self.stream_format == "audio":
            raise ValueError("timestamps cannot travel in a raw audio stream: use stream_format 'sse' (the default "
                             "with timestamps) or stream: false (a JSON body)")
        return self

    @property
    def sse(self) -> bool:
        """Streamed as SSE events: asked for, or implied by `timestamps` (a raw stream has no place for them)."""
        return self.streaming and (self.stream_format == "sse"
                                   or (self.stream_format is None and self.timestamps is not None))

    @property
    def streaming(self) -> bool:
        """Streams unless the client asks `stream: false` (every format streams: deployments/audio/encoders.py)."""
        return self.stream is not False

    def with_default_format(self, default: str) -> SpeechRequest:
        """This request with `response_format` set (the server's default when the client named none)."""
        if self.response_format is not None:
            return self
        return self.model_copy(update={"response_format": default})

    def sampling_overrides(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}


def check_unicode(value: Any) -> Any:
    """Strings must encode as UTF-8: `json.loads` accepts lone surrogates ("a\\ud800b"), tokenizers do not."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"contains an invalid Unicode code point (a lone surrogate) at position {e.start}") from None
    return value


class VoiceUploadJSON(BaseModel):
    """`POST /v1/audio/voices` as JSON (the multipart form has the same fields, with `audio_sample` a file)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=MAX_NAME_CHARS)
    audio_sample: str = Field(description="base64 or a data: URI")
    ref_text: str | None = None
    x_vector_only_mode: bool = False
    consent: str | None = Field(None, max_length=MAX_NAME_CHARS, description="the speaker's consent (OpenAI: a "
                                "consent recording's id), stored with the voice")
    replace: bool = Field(False, description="replace an existing voice of this name (one's own; admin: any)")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return check_unicode(value)


# ---------------------------------------------------------------------------------------------- WebSocket
# `/v1/audio/speech/stream` (deployments/ingress/live.py, docs/websocket.md): JSON text messages from the client.
# A context is one utterance stream; its id tags its audio frames, so it is short and plain.
ContextId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
MAX_TEXT_PIECE_CHARS = 65536  # one message's text; the context's total is limited by `ingress.max_input_chars`


class LiveOpen(SpeechRequest):
    """`open`: the fields of `POST /v1/audio/speech` (`input` = text to start with, optional) and a context id."""

    type: Literal["open"]
    context_id: ContextId
    input: str = Field("", description="text to start with (more comes with `append`)")
    idle_timeout_s: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S, description=(
        "end the context (error `text_timeout`) when no text came for this long while it waits for text; "
        "at most the server's"))

    @model_validator(mode="after")
    def _no_http_only_fields(self) -> LiveOpen:
        for name in ("stream", "stream_format", "timeout_s"):
            if getattr(self, name) is not None:
                raise ValueError(f"`{name}` does not apply on the WebSocket (contexts always stream; "
                                 "`idle_timeout_s` bounds their waits)")
        return self


class _LiveControl(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        return check_unicode(value)


class LiveAppend(_LiveControl):
    """`append`: more text, in pieces of any size (a token, a character)."""

    type: Literal["append"]
    context_id: ContextId
    text: str = Field(max_length=MAX_TEXT_PIECE_CHARS)


class LiveFlush(_LiveControl):
    """`flush`: speak the text so far to its end now, as if it ended; text after it is spoken after it."""

    type: Literal["flush"]
    context_id: ContextId


class LiveEnd(_LiveControl):
    """`end`: the context's text is complete (optionally with a last piece); `done` follows its audio."""

    type: Literal["end"]
    context_id: ContextId
    text: str = Field("", max_length=MAX_TEXT_PIECE_CHARS)


class LiveCancel(_LiveControl):
    """`cancel`: stop the context now; its engine slot is freed and `done` says `cancelled`."""

    type: Literal["cancel"]
    context_id: ContextId


LiveMessage = Annotated[LiveOpen | LiveAppend | LiveFlush | LiveEnd | LiveCancel, Field(discriminator="type")]


# The WebSocket's binary frame: one byte n, the context id (n ASCII bytes), then audio bytes of the context's
# `response_format` (a stream: concatenated, the frames of a context are one file).
def audio_frame(context_id: str, audio: bytes) -> bytes:
    """The binary WebSocket message of one piece of a context's audio."""
    tag = context_id.encode("ascii")
    return bytes([len(tag)]) + tag + audio


def parse_audio_frame(frame: bytes) -> tuple[str, bytes]:
    """-> (context id, audio bytes) of a binary message (clients; the tests and the benchmark use it)."""
    n = frame[0]
    return frame[1:1 + n].decode("ascii"), frame[1 + n:]


# ------------------------------------------------------------------ reading the WebSocket's messages
LIVE_MESSAGES = TypeAdapter(LiveMessage)
# a message that fails validation is searched for a context id (to tag the error) only this far: parsing an
# arbitrary payload again costs time and, nested deep, recursion
CONTEXT_ID_SCAN_CHARS = 64 * 1024


def auth_message_key(raw: str | None) -> str | None:
    """The key of a first message `{"type": "auth", "api_key": KEY}`, else None."""
    if not raw or len(raw) > CONTEXT_ID_SCAN_CHARS:
        return None
    with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
        message = json.loads(raw)
        if message.get("type") == "auth" and isinstance(message.get("api_key"), str):
            return message["api_key"]
    return None


def context_id_of(raw: str) -> str | None:
    """The context id of a message that failed validation, when it has a usable one (to tag the error)."""
    if len(raw) > CONTEXT_ID_SCAN_CHARS:
        return None
    with contextlib.suppress(ValueError, TypeError, AttributeError, RecursionError):
        cid = json.loads(raw).get("context_id")
        if isinstance(cid, str) and len(cid) <= 64:
            return cid
    return None


def invalid_message(e: ValidationError) -> APIError:
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return bad_request("message is not valid JSON", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ())]
    if loc and loc[0] in MESSAGE_TYPES:  # the union's tag: the message's own type, not a field
        loc = loc[1:]
    where = ".".join(loc)
    return bad_request(f"{where or 'message'}: {first.get('msg', 'invalid value')}", where or None,
                       code="invalid_message")


MESSAGE_TYPES = ("open", "append", "flush", "end", "cancel")
