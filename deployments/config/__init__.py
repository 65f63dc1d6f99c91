"""Validated configuration of the application: what the YAML `args:` of `deployments.builder:build_app` holds.

Pydantic, `extra="forbid"` everywhere (a typo fails at `serve run`, not at the first request). Engine
knobs travel as `engine_kwargs` into the stages' frozen dataclasses; Serve options travel as
`deployment_config` (the keyword arguments of `serve.deployment`), merged over the builder's defaults.

The defaults are the fastest measured configuration on a GPU (docs/serving.md): a config that names only the
model, device, dtype and GPU fraction gets it. CPU configs set the smaller sizes they need.

Here: the stages' deployments and the whole app; `common.py`: the strict base model, Serve's and a replica's device
options and `${VAR}` substitution; `ingress.py`: the ingress's settings; `aligner.py`: the Aligner's.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deployments import constants as C
from deployments.config.aligner import AlignerDeploymentConfig
from deployments.config.common import (
    NAME_PATTERN,
    BaseConfig,
    ModelKind,
    _DeviceOptions,
    _empty_is_none,
    substitute_env,
)
from deployments.config.ingress import (  # noqa: F401
    AuthConfig,
    BackpressureSettings,
    BatchSettings,
    DecodeBatchSettings,
    IngressConfig,
    LongFormSettings,
)
from stages.code2wav.engine_config import Code2WavEngineConfig
from stages.talker.engine_config import TalkerEngineConfig


class CheckpointSource(BaseConfig):
    """A checkpoint directory or Hugging Face id; None = the embedded tiny random checkpoint of `kind`."""

    model: str | None = None
    embedded_kind: ModelKind = "custom_voice"
    embedded_size: Literal["0.6b", "1.7b"] = "1.7b"

    @property
    def embedded(self) -> bool:
        return self.model is None


class _RuntimeOptions(_DeviceOptions):
    engine_cls: str | None = Field(None, description="import path 'module:Class' of the engine (tests inject fakes)")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="fields of the engine's config dataclass")

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
    model: str | None = Field(None, description="checkpoint directory or Hugging Face id; None or '' = embedded tiny")
    embedded_kind: ModelKind = "custom_voice"
    embedded_size: Literal["0.6b", "1.7b"] = "1.7b"
    _model_empty_is_none = field_validator("model", mode="before")(_empty_is_none)
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

    deterministic: bool = Field(False, description=(
        "batch-invariant mode: a seeded request's codes and audio do not depend on what runs beside it (the engine's "
        "`deterministic`: batch-invariant products on CUDA, fixed shapes on CPU; Code2Wav decodes in fixed shapes "
        "with its convolutions as products; the Talker never decodes first chunks itself). Costs throughput: "
        "docs/serving.md, 'Deterministic mode'"))

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
    def max_ongoing_requests(self) -> int:
        """Speech requests a replica holds open (set as `deployment_config.max_ongoing_requests`, else from the
        rows): the replica refuses the next as full (deployments/talker/server.py). Serve's own bound of that name
        counts calls, each of up to a batch of requests: `max_ongoing_calls`."""
        default = max(1, math.ceil(self.max_num_seqs * C.TALKER_ONGOING_PER_SLOT))
        return int(self.deployment_config.get("max_ongoing_requests", default))

    @property
    def max_ongoing_calls(self) -> int:
        """Serve's `max_ongoing_requests` of the deployment: calls, not requests, and set above what requests reach,
        so that Serve never holds a batched call at the caller while the replica could still refuse its requests
        one by one: a call queued in Serve's handle waits whole, with every request in it, past the
        `max_queued_requests` a 429 stands for. A replica's open speech requests hold one call each at most; the
        rest leaves room for live contexts' calls and for calls being refused."""
        return C.TALKER_CALLS_PER_ONGOING_REQUEST * self.max_ongoing_requests

    @property
    def max_queued_requests(self) -> int:
        """Serve's `max_queued_requests` of the deployment; an ingress replica holds at most this many speech
        requests that full replicas refused, to send again (deployments/ingress/talker_calls.py)."""
        default = max(1, math.ceil(self.max_num_seqs * C.TALKER_QUEUED_PER_SLOT))
        return int(self.deployment_config.get("max_queued_requests", default))

    @property
    def deployment_name(self) -> str:
        return C.TALKER_DEPLOYMENT_PREFIX + self.name

    @property
    def decodes_first_chunks(self) -> bool:
        """Whether the Talker decodes first chunks itself: never in deterministic mode (which decoder takes a first
        chunk depends on the load, and the two decode in other shapes)."""
        return self.first_chunk_decode_max_running > 0 and not self.deterministic

    def engine_config_kwargs(self) -> dict[str, Any]:
        """`engine_kwargs` with the deployment's defaults: rows, the compile cache (`_RuntimeOptions`), and
        `deterministic` where set."""
        extra = {"deterministic": True} if self.deterministic else {}
        return {**super().engine_config_kwargs(), "max_num_seqs": self.max_num_seqs, **extra}


class Code2WavDeploymentConfig(_RuntimeOptions):
    """The shared codec decoder: one deployment decodes chunks of every model (same 12 Hz codec)."""

    model: str | None = Field(None, description="checkpoint whose speech_tokenizer/ to load; None = the first model's")
    _model_empty_is_none = field_validator("model", mode="before")(_empty_is_none)
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



class TTSServingArgs(BaseConfig):
    """Everything `build_app` needs: the served models, the shared codec, streaming and ingress settings, the aligner."""

    models: list[TalkerDeploymentConfig] = Field(min_length=1)
    code2wav: Code2WavDeploymentConfig = Field(default_factory=Code2WavDeploymentConfig)
    streaming: StreamingConfig = Field(default_factory=StreamingConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    aligner: AlignerDeploymentConfig | None = Field(None, description=(
        "word timestamps (the API's `timestamps`): the `Aligner` deployment; absent = none, and a request asking for "
        "timestamps gets a 400"))

    @model_validator(mode="before")
    @classmethod
    def _environment(cls, value: Any) -> Any:
        """`${VAR:-default}` in any string of the args (`substitute_env`)."""
        return substitute_env(value) if isinstance(value, dict) else value

    @model_validator(mode="after")
    def _unique_model_names(self) -> TTSServingArgs:
        seen: set[str] = set()
        for m in self.models:
            for name in (m.name, *m.aliases):
                if name.lower() in seen:
                    raise ValueError(f"model name or alias {name!r} is used twice")
                seen.add(name.lower())
        # Code2Wav is shared: a deterministic model's audio needs its fixed shapes (the project's engine only)
        if any(m.deterministic for m in self.models) and self.code2wav.engine_cls is None:
            self.code2wav.engine_kwargs.setdefault("deterministic", True)
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
