"""Types that travel between the deployments (besides stages.contract's): frozen, picklable, numpy only."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.contract import SAMPLES_PER_FRAME, CodecChunk, FinishReason, TaskType

if TYPE_CHECKING:
    from stages.config import GenerationDefaults, ModelConfig
    from stages.prompts import TextTokenizer

# decode_many's keyword argument that names the replica holding the chunks' streams (stream affinity: the ingress's
# StreamPlacement sets it, Code2Wav's StreamAffinityRouter reads it)
TARGET_KWARG = "replica"


@dataclass(frozen=True)
class ModelInfo:
    """What the ingress needs of a served checkpoint to validate and tokenize requests itself.

    Sent once by each Talker deployment; the tokenizer travels pickled, so the ingress never reads
    checkpoint files (it may run on a node without them).
    """

    name: str
    aliases: tuple[str, ...]
    config: ModelConfig
    generation: GenerationDefaults
    tokenizer: TextTokenizer
    max_seq_len: int  # prompt positions + frames of one request
    max_text_rows: int  # text positions of one utterance (the engine's `max_text_rows`)
    fingerprint: str  # identifies the weights: cached voice-clone prompts are keyed by it
    default_max_new_tokens: int

    @property
    def task(self) -> TaskType:
        return self.config.task

    @property
    def speakers(self) -> list[str]:
        return sorted(self.config.talker.speakers)

    def describe(self) -> dict[str, Any]:
        return {
            "task_type": self.task.value,
            "model_size": self.config.model_size,
            "speakers": self.speakers,
            "languages": self.config.public_languages,
            "accepts_instructions": self.config.accepts_instruction,
            "max_seq_len": self.max_seq_len,
        }


@dataclass(frozen=True)
class GenerateOptions:
    """Per-request knobs of the Talker's chunking and live text, beside the SynthesisRequest (whose `max_frames`
    the ingress already fitted to the engine's `max_seq_len`: deployments/ingress/request_builder.py)."""

    first_chunk_frames: int | None = None  # None: the configured schedule
    text_idle_timeout_s: float | None = None  # live text: the request's own idle timeout (<= the engine's)


class ReplicaFullError(RuntimeError):
    """A Talker replica refused a request of a batched call: it already holds its config's `max_ongoing_requests`
    speech requests open. The ingress sends the request again in a later batch, which Serve may route to another
    replica (deployments/ingress/talker_calls.py), as Serve queues a one-request call at the caller."""


@dataclass(frozen=True)
class Admitted:
    """A request's first item of its share of a batched Talker call's stream (`generate_many`,
    `generate_live_many`: deployments/ingress/talker_calls.py): the Talker took the request (Serve admitted the call,
    the engine accepted it). A live request's pipeline yields it too: the WebSocket answers `opened` on it."""

    request_id: str


@dataclass(frozen=True)
class CallItem:
    """One item of one of the requests that share a batched Talker call (`generate_many`, `generate_live_many`): its
    `Admitted`, then its codec chunks; its last, neither `item` nor `error`, says its stream ended (an aborted
    request may end without a final chunk); or instead the error that refused or ended it."""

    request_id: str
    item: Admitted | CodecChunk | None = None
    error: BaseException | None = None

    @classmethod
    def failed(cls, request_id: str, error: BaseException) -> CallItem:
        """The item of a request that `error` ended. An error that does not pickle and unpickle goes as a
        RuntimeError with its type and message: the message carries the other requests' items too, and must not
        fail with it."""
        try:
            pickle.loads(pickle.dumps(error))
        except Exception:
            error = RuntimeError(f"{type(error).__name__}: {error}")
        return cls(request_id, error=error)


@dataclass(frozen=True)
class DecodedChunk:
    """Code2Wav's answer for one CodecChunk: int16 PCM of its new frames, and the chunk's stream position."""

    request_id: str
    seq: int
    pcm: np.ndarray  # [new_frames * 1920] int16
    final: bool
    finish_reason: FinishReason | None
    stamps: tuple[float, ...] = ()  # first chunk: Code2Wav's wall times (deployments/first_audio_timing.py)
    replica: str | None = None  # the stateful Code2Wav replica now holding the stream's state (stream affinity)
    pause: bool = False  # silence the ingress put between two pieces of a long input (no codec frames)

    @property
    def codec_frames(self) -> int:
        """Codec frames this chunk's audio came from (the usage a client is told)."""
        return 0 if self.pause else self.pcm.size // SAMPLES_PER_FRAME


def talker_decoded(chunk: CodecChunk) -> DecodedChunk | None:
    """The answer for a chunk the Talker decoded itself (it carries `pcm`: deployments/talker/first_chunk_decoder.py);
    None for a chunk Code2Wav must decode."""
    if chunk.pcm is None:
        return None
    return DecodedChunk(chunk.request_id, chunk.seq, chunk.pcm, chunk.final, chunk.finish_reason)


@dataclass(frozen=True)
class AlignRequest:
    """One piece of audio to time against its text (`Aligner.align`, deployments/aligner/server.py); the answer is
    `list[stages.aligner.timestamps.Word]`, times in seconds from the start of `pcm`."""

    request_id: str
    pcm: np.ndarray  # [n] int16 mono at stages.contract.SAMPLE_RATE (24 kHz)
    text: str
    language: str | None = None  # None or "auto": no language hint


@dataclass(frozen=True)
class AlignerInfo:
    """What the ingress needs to know of the Aligner deployment before it sends work (`Aligner.info`)."""

    max_seconds: float  # the longest audio one `align` call times (longer: a 400 "audio_too_long")
    languages: tuple[str, ...]  # the language hints it takes besides None/"auto" (case-insensitive); others: a 400
