"""The Aligner deployment's settings: word timestamps of the audio served (docs/aligner.md, "Serving")."""

from __future__ import annotations

from pydantic import Field, field_validator

from deployments import constants as C
from deployments.config.common import _DeviceOptions, _empty_is_none


class AlignerDeploymentConfig(_DeviceOptions):
    """A Qwen3-ForcedAligner checkpoint served as the `Aligner` deployment; absent from the args, there is none."""

    model: str | None = Field(None, description=(
        "aligner checkpoint directory or Hugging Face id (Qwen/Qwen3-ForcedAligner-0.6B); None or '' = an embedded "
        "tiny random aligner (the API works end to end, the times are meaningless)"))
    _model_empty_is_none = field_validator("model", mode="before")(_empty_is_none)
    max_batch_size: int = Field(32, ge=1, description="pieces of audio timed in one forward")
    max_batch_audio_s: float = Field(480.0, gt=0, description=(
        "a forward's padded audio, pieces x its longest piece's seconds, at most this (bounds a forward's memory "
        "and time); a longer piece is timed alone"))
    stall_timeout_s: float = Field(C.ALIGNER_STALL_TIMEOUT_S, gt=0, description=(
        "check_health fails (Serve replaces the replica) when pieces wait this long without a forward finishing"))
