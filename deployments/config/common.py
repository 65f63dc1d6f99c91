"""The config's building blocks: the strict base model, Serve's deployment options, a replica's device options,
`${VAR}` substitution."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

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


ENV_REFERENCE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}")


def substitute_env(value: Any, environ: Mapping[str, str] | None = None, where: str = "args") -> Any:
    """`value` (the YAML `args:` tree) with `${VAR}`, `${VAR:-default}` (unset or empty) and `${VAR-default}`
    (unset) replaced in every string, as a POSIX shell does; `$$` is a literal `$`. An unset `${VAR}` without a
    default is an error naming the variable and where it is used. Serve passes `args` as written (it expands
    nothing), so the variables are read where the application is built: the Ray cluster's environment, or the
    application's `runtime_env.env_vars`."""
    environ = os.environ if environ is None else environ
    if isinstance(value, dict):
        return {k: substitute_env(v, environ, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [substitute_env(v, environ, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or "$" not in value:
        return value

    def replace(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, default = match.groups()
        current = environ.get(name)
        if operator == ":-" and not current or operator == "-" and current is None:
            return default
        if current is None:
            raise ValueError(f"{where}: environment variable {name} is not set (write ${{{name}:-default}} "
                             "for a default)")
        return current

    return ENV_REFERENCE.sub(replace, value)


def _empty_is_none(value: Any) -> Any:
    """`model: ${QWEN3_TTS_MODEL:-}` with the variable unset: the embedded checkpoint, as `model: null`."""
    return None if isinstance(value, str) and not value.strip() else value


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
        "max_ongoing_requests, ...), merged over the builder's defaults. A Talker's max_ongoing_requests and "
        "max_queued_requests count speech requests (per replica, and waiting for a slot per ingress replica); "
        "Serve's own call bound of a Talker is twice its max_ongoing_requests.",
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



class _DeviceOptions(_DeploymentOptions):
    """Where and how a replica runs its model (deployments/loading.configure_torch)."""

    device: str = Field("auto", description="'auto' (cuda if present, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: str = Field("auto", description=f"'auto' (bfloat16 on cuda, float32 on cpu) or one of {DTYPES[1:]}")
    cpu_threads: int | None = Field(None, ge=1, description="torch.set_num_threads in the replica")
    gpu_memory_fraction: float | None = Field(
        None, gt=0, le=1, description="torch.cuda.set_per_process_memory_fraction: Ray does not isolate GPU memory"
    )
    warmup: bool = Field(True, description=(
        "pay one-time costs before reporting ready: a first real request, and the compiles and CUDA graph captures "
        "of an engine that has them"))

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
