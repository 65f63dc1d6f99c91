"""The ingress's settings (`args.ingress`): limits, OpenAI names and defaults, API keys, backpressure, decode
batching, batch jobs and long inputs."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments import constants as C
from deployments.config.common import BaseConfig, _DeploymentOptions


class BackpressureSettings(BaseConfig):
    """The answer when a deployment's queue is full: the ingress's own (Serve's backpressure_config)
    and the one the ingress gives when a Talker/Code2Wav handle refuses a request."""

    status_code: Literal[429, 503] = 429
    retry_after_s: float = Field(C.DEFAULT_RETRY_AFTER_S, ge=0)


class DecodeBatchSettings(BaseConfig):
    """How an ingress replica sends its streams' chunks to Code2Wav (deployments/ingress/decode_batcher.py)."""

    max_chunks: int = Field(C.DEFAULT_DECODE_BATCH_MAX_CHUNKS, ge=1, description="chunks in one decode call at most")
    max_calls_in_flight: int = Field(C.DEFAULT_DECODE_CALLS_IN_FLIGHT, ge=1,
                                     description="decode calls of this replica in flight; more chunks wait and join")
    stream_affinity: Literal["auto", "on", "off"] = Field("auto", description=(
        "keep each stream's chunks on the Code2Wav replica holding its decoder state (deployments/ingress/placement.py);"
        " only a stateful Code2Wav has one; auto: on where it may run several replicas; off: Serve's own routing"))

    @field_validator("stream_affinity", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        """YAML 1.1 (Serve's config files, `--set k=off`) reads an unquoted on/off as true/false."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class BatchSettings(BaseConfig):
    """Batch jobs (`/v1/audio/speech/batches`, deployments/ingress/batch_jobs.py): where their state lives and how
    each ingress replica works through them."""

    store_dir: str | None = Field(None, description=(
        "the jobs' SQLite database and their items' audio; default <serve home>/batches/<Serve application name>. "
        "The ingress replicas of one application share it (one host: any disk; several nodes: shared storage with "
        "POSIX locks and `journal_mode: delete`); never two applications"))
    journal_mode: Literal["wal", "delete"] = Field("wal", description=(
        "SQLite's journal: wal needs every replica on one host (its index is shared memory); delete works on "
        "shared storage across nodes"))
    max_items: int = Field(C.DEFAULT_BATCH_MAX_ITEMS, ge=1, description="requests in one job at most")
    items_in_flight: int = Field(C.DEFAULT_BATCH_ITEMS_IN_FLIGHT, ge=1, description=(
        "items one ingress replica synthesizes at once (each is a low-priority Talker request)"))
    lease_s: float = Field(C.DEFAULT_BATCH_LEASE_S, gt=0, description=(
        "an item a replica claimed and stopped renewing (the replica died) is claimed again after this"))
    max_attempts: int = Field(3, ge=1, description="claims of one item at most (a replica died with it each time)")
    retention_s: float = Field(C.DEFAULT_BATCH_RETENTION_S, gt=0, description=(
        "a finished or cancelled job, its items' audio included, is deleted this long after it ended"))

    def store_path(self, app_name: str) -> Path:
        """One store per application: another app's replicas would claim its items for their own models."""
        return Path(self.store_dir).expanduser() if self.store_dir else C.DEFAULT_BATCH_STORE_DIR / app_name


class LongFormSettings(BaseConfig):
    """An input longer than one Talker request: split into pieces run one after another into one response
    (deployments/ingress/long_text.py, long_form.py)."""

    sentence_pause_s: float = Field(0.3, ge=0, le=10, description=(
        "silence between two pieces where a sentence ends (after the model's own trailing breath)"))
    paragraph_pause_s: float = Field(0.7, ge=0, le=10, description="silence between two pieces where a paragraph ends")
    piece_fill: float = Field(0.5, gt=0, le=1, description=(
        "share of one Talker request (max_seq_len) a piece's estimated speech may fill; the rest is margin for "
        "slower speech, so a piece ends by EOS before its frame cap"))


def _default_voice_aliases() -> dict[str, str]:
    from deployments.ingress.voice_aliases import DEFAULT_VOICE_ALIASES  # imported late: the ingress imports this

    return dict(DEFAULT_VOICE_ALIASES)


class AuthConfig(BaseConfig):
    """API keys (deployments/ingress/api_keys.py): off without a keys file; then the server trusts every client
    that can reach it. Per-key limits: these defaults, overridden on a key's line (docs/serving.md "API keys")."""

    keys_file: str | None = Field(None, description=(
        "one key a line: `KEY SCOPES [streams=N] [rpm=N]`; reloaded when it changes; unset: env "
        f"{C.API_KEYS_FILE_ENV}, else auth is off"))
    max_concurrent_streams: int | None = Field(C.DEFAULT_KEY_MAX_CONCURRENT_STREAMS, ge=1, description=(
        "speech requests and WebSocket contexts one key has open at once, across ingress replicas; null: no limit"))
    requests_per_minute: int | None = Field(C.DEFAULT_KEY_REQUESTS_PER_MINUTE, ge=1, description=(
        "speech requests, WebSocket contexts and voice uploads one key starts per minute, across ingress replicas; "
        "null: no limit"))

    @model_validator(mode="before")
    @classmethod
    def _keys_file_from_env(cls, value: Any) -> Any:
        """Resolved where the config is validated (the process that builds the app), then travels with it."""
        if isinstance(value, dict) and value.get("keys_file") is None and os.environ.get(C.API_KEYS_FILE_ENV):
            return {**value, "keys_file": os.environ[C.API_KEYS_FILE_ENV]}
        return value


class IngressConfig(_DeploymentOptions):
    stage_transport: Literal["grpc", "object_ref"] = Field("grpc", description=(
        "how chunks travel Talker -> ingress -> Code2Wav: Serve's gRPC transport by value, or Ray actor calls "
        "forwarding object refs (deployments/transport.py)"))
    max_input_chars: int = Field(C.DEFAULT_MAX_INPUT_CHARS, ge=1, description=(
        "characters of one speech request's `input` (a longer input runs as several Talker requests: `long_form`); "
        "also of a WebSocket context's text"))
    max_instructions_chars: int = Field(C.DEFAULT_MAX_INSTRUCTIONS_CHARS, ge=1)
    max_ref_text_chars: int = Field(C.DEFAULT_MAX_REF_TEXT_CHARS, ge=1)
    max_ref_audio_bytes: int = Field(C.DEFAULT_MAX_REF_AUDIO_BYTES, ge=1, description="decoded bytes of a reference clip")
    max_ref_audio_seconds: float = Field(C.DEFAULT_MAX_REF_AUDIO_SECONDS, gt=0)
    max_request_bytes: int = Field(C.DEFAULT_MAX_REQUEST_BYTES, ge=1, description="HTTP body limit (413 above)")
    max_new_tokens_limit: int | None = Field(None, ge=1, description="cap on a request's max_new_tokens")
    request_timeout_s: float = Field(C.DEFAULT_REQUEST_TIMEOUT_S, gt=0, description="per-request deadline")
    body_read_timeout_s: float = Field(C.DEFAULT_BODY_READ_TIMEOUT_S, gt=0,
                                       description="a request body must arrive whole within this (408 otherwise)")
    max_open_requests: int = Field(C.DEFAULT_INGRESS_MAX_OPEN_REQUESTS, ge=1, description=(
        "speech requests (open streams included) and voice uploads in progress per ingress replica; more are "
        "answered with `backpressure` (429 + Retry-After) by the ingress itself"))
    ref_audio_url_allowlist: list[str] = Field(
        default_factory=list,
        description="http(s) URL prefixes ref_audio may be fetched from (e.g. 'https://cdn.example.com/voices/'); "
        "empty = no URLs. Local files are never read.",
    )
    voices_dir: str | None = Field(None, description="uploaded voices (shared storage when there are several nodes)")
    max_uploaded_voices: int = Field(C.DEFAULT_MAX_UPLOADED_VOICES, ge=0)
    max_contexts_per_connection: int = Field(C.DEFAULT_MAX_CONTEXTS_PER_CONNECTION, ge=1, description=(
        "contexts (utterances) open at once on one `/v1/audio/speech/stream` WebSocket; each also counts in "
        "max_open_requests"))
    websocket_idle_timeout_s: float = Field(C.DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S, gt=0, description=(
        "a `/v1/audio/speech/stream` WebSocket with no open context this long is closed (1000); the time runs "
        "from the connection, or from its last context's end"))
    max_websockets_per_replica: int = Field(C.DEFAULT_MAX_WEBSOCKETS_PER_REPLICA, ge=1, description=(
        "WebSockets one ingress replica holds; more are refused (an error message, then close 1013)"))
    max_websockets_per_client: int = Field(C.DEFAULT_MAX_WEBSOCKETS_PER_CLIENT, ge=1, description=(
        "WebSockets one client address holds on one ingress replica; more are refused as above"))
    allow_suppress_eos: bool = Field(False, description=(
        "accept `suppress_eos` (benchmarks, random-weight tests); off in production: it lets any client force "
        "maximum-length generation"))
    min_fitted_frames: int = Field(C.DEFAULT_MIN_FITTED_FRAMES, ge=1, description=(
        "a request without max_new_tokens whose prompt leaves fewer frames than this within max_seq_len is a "
        "400 (rather than a truncated clip of a few frames)"))
    voice_aliases: dict[str, str] = Field(default_factory=_default_voice_aliases, description=(
        "voice names (OpenAI's by default) -> CustomVoice speakers (deployments/ingress/voice_aliases.py)"))
    default_response_format: str = Field("mp3", description="response_format of a request that names none "
                                         "(OpenAI's default)")
    auth: AuthConfig = Field(default_factory=AuthConfig)
    backpressure: BackpressureSettings = Field(default_factory=BackpressureSettings)
    decode_batch: DecodeBatchSettings = Field(default_factory=DecodeBatchSettings)
    batch: BatchSettings = Field(default_factory=BatchSettings)
    long_form: LongFormSettings = Field(default_factory=LongFormSettings)

    @field_validator("ref_audio_url_allowlist")
    @classmethod
    def _http_prefixes(cls, value: list[str]) -> list[str]:
        for prefix in value:
            if not re.match(r"^https?://[^/]+/", prefix):
                raise ValueError(f"allowlist entry {prefix!r} must be an http(s) URL prefix ending its host with '/'")
        return value

    @field_validator("voice_aliases")
    @classmethod
    def _lower_case_aliases(cls, value: dict[str, str]) -> dict[str, str]:
        return {k.strip().lower(): v.strip().lower() for k, v in value.items()}

    @field_validator("default_response_format")
    @classmethod
    def _known_format(cls, value: str) -> str:
        from deployments.audio.formats import FORMATS

        if value not in FORMATS:
            raise ValueError(f"default_response_format {value!r} is not one of {sorted(FORMATS)}")
        return value

    @property
    def voices_path(self) -> Path:
        return Path(self.voices_dir).expanduser() if self.voices_dir else C.DEFAULT_VOICES_DIR

