"""Validated configuration of the application: what the YAML `args:` of `deployments.builder:build_app` holds.

Pydantic, `extra="forbid"` everywhere (a typo fails at `serve run`, not at the first request). Engine
knobs travel as `engine_kwargs` into the stages' frozen dataclasses; Serve options travel as
`deployment_config` (the keyword arguments of `serve.deployment`), merged over the builder's defaults.

The defaults are the fastest measured configuration on a GPU (docs/serving.md): a config that names only the
model, device, dtype and GPU fraction gets it. CPU configs set the smaller sizes they need.
"""

from __future__ import annotations

import inspect
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deployments import constants as C
from stages.code2wav.engine_config import Code2WavEngineConfig
from stages.talker.engine_config import TalkerEngineConfig

ModelKind = Literal["custom_voice", "base", "voice_design"]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,127}$"
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "float32", "fp32")  # stages.checkpoint.parse_dtype's


def _serve_deployment_options() -> frozenset[str]:
    from ray import serve

    return frozenset(inspect.signature(serve.deployment).parameters) - {"_func_or_class", "name", "version"}


def _autoscaling_keys() -> frozenset[str]:
    from ray.serve.config import AutoscalingConfig

    return frozenset(AutoscalingConfig.model_fields)


class BaseConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    @classmethod
    def from_file(cls, path: str | Path):
        with open(path, encoding="utf-8") as f:
            return cls.model_validate(yaml.safe_load(f) or {})


class _DeploymentOptions(BaseConfig):
    deployment_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of serve.deployment (ray_actor_options, autoscaling_config, "
        "max_ongoing_requests, ...), merged over the builder's defaults.",
    )

    @field_validator("deployment_config")
    @classmethod
    def _known_serve_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = set(value) - _serve_deployment_options()
        if unknown:
            raise ValueError(f"unknown Serve deployment options {sorted(unknown)}")
        autoscaling = value.get("autoscaling_config")
        if isinstance(autoscaling, dict) and (unknown := set(autoscaling) - _autoscaling_keys()):
            raise ValueError(f"unknown autoscaling_config keys {sorted(unknown)}; Serve's AutoscalingConfig has "
                             f"{sorted(_autoscaling_keys())}")
        return value


class CheckpointSource(BaseConfig):
    """A checkpoint directory or Hugging Face id; None = the embedded tiny random checkpoint of `kind`."""

    model: str | None = None
    embedded_kind: ModelKind = "custom_voice"
    embedded_size: Literal["0.6b", "1.7b"] = "1.7b"

    @property
    def embedded(self) -> bool:
        return self.model is None


class _RuntimeOptions(_DeploymentOptions):
    device: str = Field("auto", description="'auto' (cuda if present, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: str = Field("auto", description=f"'auto' (bfloat16 on cuda, float32 on cpu) or one of {DTYPES[1:]}")
    engine_cls: str | None = Field(None, description="import path 'module:Class' of the engine (tests inject fakes)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="fields of the engine's config dataclass")
    cpu_threads: int | None = Field(None, ge=1, description="torch.set_num_threads in the replica")
    gpu_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="torch.cuda.set_per_process_memory_fraction: Ray does not isolate GPU memory"
    )
    warmup: bool = Field(True, description="run one real request before reporting ready")

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.match(DEVICE_PATTERN, value):
            raise ValueError(f"device {value!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N'")
        return value

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"dtype {value!r} is not one of {list(DTYPES)}")
        return value

    def engine_config_kwargs(self) -> dict[str, Any]:
        """`engine_kwargs` with the compile cache under the serve home for the project's own engine (its config has
        one; `engine_kwargs.compile_cache_dir: null` turns it off)."""
        kwargs = dict(self.engine_kwargs)
        if self.engine_cls is None and "compile_cache_dir" not in kwargs:
            kwargs["compile_cache_dir"] = str(C.COMPILE_CACHE_DIR)
        return kwargs


class TalkerDeploymentConfig(_RuntimeOptions):
    """One served checkpoint: its own `Talker:<name>` deployment, routed to by the request's `model`."""

    name: str = Field(pattern=NAME_PATTERN, description="the `model` clients ask for")
    aliases: list[str] = Field(default_factory=list, description="other `model` values routed here")
    model: str | None = Field(None, description="checkpoint directory or Hugging Face id; None = embedded tiny")
    embedded_kind: ModelKind = "custom_voice"
    embedded_size: Literal["0.6b", "1.7b"] = "1.7b"
    default_max_new_tokens: int = Field(C.DEFAULT_MAX_NEW_TOKENS, ge=1, description="frames when a request sets none")
    first_chunk_decode_max_running: int = Field(160, ge=0, description=(
        "the Talker decodes a stream's first chunk itself (in its own CUDA context, sent back with the codes) "
        "while at most this many requests run in its engine; 0 = never (deployments/talker/first_chunk_decoder.py)"))
    first_chunk_decode_count_pending: bool = Field(True, description=(
        "the first-chunk gate counts the Talker's pending first-chunk decodes as running requests: arrivals one by one "
        "are decoded there, a burst's first chunks beyond the limit go to Code2Wav"))
    first_chunk_decode_max_batch: int = Field(8, ge=1, le=64, description=(
        "first chunks the Talker decodes in one forward (those waiting while its last decode ran)"))
    first_chunk_decode_compile: bool = Field(True, description=(
        "where the Talker's engine compiles (`engine_kwargs.compile`, CUDA), its first-chunk decoder compiles the "
        "codec's dequantizer and pre-transformer too: first audio sooner, a first start longer, a start from the "
        "compile cache no longer (docs/serving.md)"))

    @field_validator("aliases")
    @classmethod
    def _alias_names(cls, value: list[str]) -> list[str]:
        for alias in value:
            if not re.match(NAME_PATTERN, alias):
                raise ValueError(f"alias {alias!r} must match {NAME_PATTERN}")
        return value

    @field_validator("engine_kwargs")
    @classmethod
    def _slots_positive(cls, value: dict[str, Any]) -> dict[str, Any]:
        if int(value.get("max_num_seqs", 1)) < 1:
            raise ValueError("engine_kwargs.max_num_seqs must be >= 1")
        return value

    @property
    def source(self) -> CheckpointSource:
        return CheckpointSource(model=self.model, embedded_kind=self.embedded_kind, embedded_size=self.embedded_size)

    @property
    def max_num_seqs(self) -> int:
        """Engine rows (requests running at once): what `max_ongoing_requests` and the autoscaling target are
        derived from."""
        return int(self.engine_kwargs.get("max_num_seqs", TalkerEngineConfig.max_num_seqs))

    @property
    def deployment_name(self) -> str:
        return C.TALKER_DEPLOYMENT_PREFIX + self.name

    def engine_config_kwargs(self) -> dict[str, Any]:
        """`engine_kwargs` with the deployment's defaults: rows, and the compile cache (`_RuntimeOptions`)."""
        return {**super().engine_config_kwargs(), "max_num_seqs": self.max_num_seqs}


class Code2WavDeploymentConfig(_RuntimeOptions):
    """The shared codec decoder: one deployment decodes chunks of every model (same 12 Hz codec)."""

    model: str | None = Field(None, description="checkpoint whose speech_tokenizer/ to load; None = the first model's")
    max_batch_size: int = Field(Code2WavEngineConfig.max_batch_size, ge=1, description="chunks decoded in one forward")
    batch_fill_chunks: int = Field(64, ge=0, description=(
        "a batch of fewer chunks waits up to batch_fill_wait_ms for more, unless it holds a stream's first two "
        "chunks (their listener waits): fewer, larger decodes beside the Talker's steps on a shared GPU; "
        "0 = a batch never waits"))
    batch_fill_wait_ms: float = Field(20.0, ge=0, description="the longest a batch waits to fill (batch_fill_chunks)")
    batch_fill_idle_wait_ms: float = Field(60.0, ge=0, description=(
        "while the decoder was busy less than half of the last second, a batch of later chunks waits up to this "
        "long instead of batch_fill_wait_ms, and one holding a stream's last chunk leaves at once: an idle "
        "decoder loses nothing by waiting, and its fewer forwards leave a shared GPU to the Talker; 0 = off"))
    stall_timeout_s: float = Field(C.CODE2WAV_STALL_TIMEOUT_S, gt=0, description=(
        "check_health fails (Serve replaces the replica) when chunks wait this long without a decode finishing"))

    @property
    def stateful(self) -> bool:
        """Whether the engine keeps each stream's decoder state (the engine config's default unless set)."""
        return bool(self.engine_kwargs.get("stateful", Code2WavEngineConfig.stateful))

    def may_run_several_replicas(self) -> bool:
        """Whether the deployment may run more than one replica (a fixed count above 1, "auto", or autoscaling
        to more than 1)."""
        count = self.deployment_config.get("num_replicas", 1)
        autoscaling = self.deployment_config.get("autoscaling_config") or {}
        return count == "auto" or (isinstance(count, int) and count > 1) or autoscaling.get("max_replicas", 1) > 1


class StreamingConfig(BaseConfig):
    """How a stream of frames is cut into chunks for Code2Wav: `stages.chunking.ChunkSchedule`.

    Unset fields take the schedule's defaults (a geometric ramp, steady chunks), except the first chunk: one frame,
    first audio after one frame (docs/serving.md).
    """

    first_chunk_frames: int | None = Field(1, ge=1, description="new frames of the first chunk (80 ms each)")
    steady_chunk_frames: int | None = Field(None, ge=1, description="new frames of chunks after the ramp")
    left_context_frames: int | None = Field(None, ge=0, description="played frames decoded again as context")
    ramp_factor: float | None = Field(None, gt=1, description="geometric growth of chunks after the first")
    ramp: list[int] | None = Field(None, description="explicit sizes of chunks 1, 2, ... (then steady)")
    ref_context_frames: int | None = Field(None, ge=0, description="reference frames (Base ICL) as chunk 0 context")
    max_pending_decodes: int = Field(C.DEFAULT_MAX_PENDING_DECODES, ge=1, description="decodes in flight per stream")

    def schedule(self):
        """-> stages.chunking.ChunkSchedule (raises ValueError on an inconsistent schedule)."""
        from stages.chunking import ChunkSchedule

        fields = self.model_dump(exclude={"max_pending_decodes"}, exclude_none=True)
        if "ramp" in fields:
            fields["ramp"] = tuple(fields["ramp"])
        return ChunkSchedule(**fields)


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
    max_input_chars: int = Field(C.DEFAULT_MAX_INPUT_CHARS, ge=1)
    max_instructions_chars: int = Field(C.DEFAULT_MAX_INSTRUCTIONS_CHARS, ge=1)
    max_ref_text_chars: int = Field(C.DEFAULT_MAX_INPUT_CHARS, ge=1)
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


class TTSServingArgs(BaseConfig):
    """Everything `build_app` needs: the served models, the shared codec, streaming and ingress settings."""

    models: list[TalkerDeploymentConfig] = Field(min_length=1)
    code2wav: Code2WavDeploymentConfig = Field(default_factory=Code2WavDeploymentConfig)
    streaming: StreamingConfig = Field(default_factory=StreamingConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)

    @model_validator(mode="after")
    def _unique_model_names(self) -> TTSServingArgs:
        seen: set[str] = set()
        for m in self.models:
            for name in (m.name, *m.aliases):
                if name.lower() in seen:
                    raise ValueError(f"model name or alias {name!r} is used twice")
                seen.add(name.lower())
        return self

    @property
    def codec_source(self) -> CheckpointSource:
        """Where Code2Wav loads the codec decoder from: its own `model`, else the first model's checkpoint."""
        if self.code2wav.model is not None:
            return CheckpointSource(model=self.code2wav.model)
        return self.models[0].source

    @property
    def stream_affinity(self) -> bool:
        """Whether the ingress keeps each stream on the Code2Wav replica holding its state (and Code2Wav routes by
        `deployments.code2wav.router.StreamAffinityRouter`): a stateful Code2Wav, `on`, or `auto` where it may run
        several replicas (with one, every call reaches the state anyway)."""
        choice = self.ingress.decode_batch.stream_affinity
        several = self.code2wav.may_run_several_replicas()
        return self.code2wav.stateful and (choice == "on" or (choice == "auto" and several))
