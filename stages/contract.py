"""The data that crosses stage boundaries (and Ray): prompts, sampling parameters, codec chunks, errors.

Everything here is a frozen, picklable dataclass holding numpy arrays or plain Python values, never
torch tensors on a device, so it can travel through Ray's object store between processes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

# The model's shape facts, here once (every 12 Hz release): codebooks per frame, codes per codebook.
NUM_CODEBOOKS = 16
CODEBOOK_SIZE = 2048
SAMPLES_PER_FRAME = 1920
SAMPLE_RATE = 24000
FRAME_SECONDS = SAMPLES_PER_FRAME / SAMPLE_RATE  # 80 ms of audio per frame


class InvalidRequestError(ValueError):
    """A request the model cannot serve (unknown speaker/language, wrong task, missing reference text).

    The ingress maps it to HTTP 400; the message names the problem.
    """


class EngineOverloadedError(RuntimeError):
    """An engine's waiting queue is full; the caller should shed load (HTTP 503 + Retry-After)."""


class TextTimeoutError(TimeoutError):
    """A live-text request waited longer than the engine's idle timeout for its next text; it has ended."""


class LiveTextEvictedError(TextTimeoutError):
    """A live-text request ended to free its slot and KV: it waited for text while other requests waited for
    a slot, or it outlived the engine's maximum live-request lifetime."""


class TaskType(str, enum.Enum):
    CUSTOM_VOICE = "CustomVoice"
    VOICE_DESIGN = "VoiceDesign"
    BASE = "Base"


class Priority(enum.IntEnum):
    """Who waits for a request's audio: the Talker's scheduler admits real-time requests first
    (stages/talker/scheduler.py); batch work gets only the capacity they leave idle."""

    REALTIME = 0  # a listener or a client waits (speech, long-form, WebSocket)
    BATCH = 1  # a batch job's item (deployments/ingress/batch_worker.py): nobody listens as it is made


@dataclass(frozen=True)
class SamplingParams:
    """Official sampling semantics (generation_config.json of every release).

    `do_sample=False` is greedy; repetition penalty, min frames and suppressed ids still apply.
    """

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    min_frames: int = 2  # EOS is masked for the first `min_frames` sampled codebook-0 tokens
    suppress_eos: bool = False  # benchmarks/tests: random weights stop at random, this forces full length

    def validate(self) -> None:
        if self.temperature <= 0 and self.do_sample:
            raise InvalidRequestError("temperature must be > 0 when sampling")
        if self.subtalker_temperature <= 0 and self.subtalker_do_sample:
            raise InvalidRequestError("subtalker_temperature must be > 0 when sampling")
        if self.top_k < 0 or self.subtalker_top_k < 0:
            raise InvalidRequestError("top_k must be >= 0 (0 disables it)")
        if not (0.0 < self.top_p <= 1.0) or not (0.0 < self.subtalker_top_p <= 1.0):
            raise InvalidRequestError("top_p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty must be > 0")
        if self.min_frames < 0:
            raise InvalidRequestError("min_frames must be >= 0")


@dataclass(frozen=True)
class VoiceClonePrompt:
    """A Base-model voice: x-vector always, reference codes + transcript ids for in-context (ICL) mode."""

    x_vector: np.ndarray  # [enc_dim] float32
    ref_codes: np.ndarray | None = None  # [T_ref, 16] int64; None = x-vector-only mode
    ref_text_ids: tuple[int, ...] | None = None  # transcript tokens (between role and <|im_end|>)

    @property
    def icl(self) -> bool:
        return self.ref_codes is not None


@dataclass(frozen=True)
class TalkerPrompt:
    """Everything the talker needs to build its prefill, already tokenized and validated.

    Built by `stages.prompts.build_prompt`; turned into embeddings by the talker model on its device.
    """

    text_ids: tuple[int, ...]  # target text tokens (between the role and <|im_end|>)
    language_id: int | None  # codec id of the language (dialect rule applied); None = "auto"
    speaker_id: int | None = None  # CustomVoice speaker codec id
    instruct_ids: tuple[int, ...] | None = None  # the whole `<|im_start|>user\n...<|im_end|>\n` ids
    voice: VoiceClonePrompt | None = None  # Base voice clone
    non_streaming_text: bool = False  # True: all text in the prefill; False: text fed one token per frame
    role_ids: tuple[int, ...] = (151644, 77091, 198)  # `<|im_start|>assistant\n` as tokenized with the text

    @property
    def ref_codes(self) -> np.ndarray | None:
        return None if self.voice is None else self.voice.ref_codes


@dataclass(frozen=True)
class SynthesisRequest:
    """One request to the talker engine."""

    request_id: str
    prompt: TalkerPrompt
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_frames: int = 2048  # frames of audio at most (80 ms each)
    seed: int | None = None  # None: drawn by the engine
    priority: Priority = Priority.REALTIME


class FinishReason(str, enum.Enum):
    EOS = "eos"  # the model produced the stop code
    LENGTH = "length"  # max_frames reached
    ABORTED = "aborted"  # cancelled (client left, deadline)
    ERROR = "error"


@dataclass(frozen=True)
class CodecChunk:
    """Frames of one stream for Code2Wav: `codes[:context]` are left context, the rest are new.

    Code2Wav is stateless: it decodes `codes` and returns only the samples of the new frames
    (`(len(codes) - context) * 1920`).
    """

    request_id: str
    seq: int  # 0, 1, 2, ... in stream order
    codes: np.ndarray  # [context + new, 16] int64
    context: int
    final: bool = False
    finish_reason: FinishReason | None = None
    # wall times (time.time()) on a stream's first chunk, by name (deployments/first_audio_timing.py): the engine's
    # "queued" (its prefill had its text) and "prefilled", then the serving path's ("started", "cut", "left", live
    # "text_in")
    stamps: dict[str, float] = field(default_factory=dict)
    # int16 PCM of the new frames when the Talker decoded the chunk itself (deployments/talker/first_chunk_decoder.py)
    pcm: np.ndarray | None = None

    @property
    def num_new(self) -> int:
        return int(self.codes.shape[0]) - self.context
