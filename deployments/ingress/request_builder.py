"""From a `SpeechRequest` to a `SynthesisRequest`: which model, which voice, prompt, sampling, length.

Pure functions over `ModelInfo` (no Ray, no I/O): every 4xx about the request's content is raised
here or by `stages.prompts.build_prompt` (InvalidRequestError), before any engine slot is taken.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from deployments import constants as C
from deployments.config import IngressConfig, TTSServingArgs
from deployments.errors import APIError, bad_request, shown
from deployments.ingress.schemas import SpeechRequest
from deployments.ingress.voice_aliases import alias_target
from deployments.ingress.voice_store import VoiceRecord
from deployments.messages import GenerateOptions, ModelInfo
from stages.contract import InvalidRequestError, Priority, SamplingParams, SynthesisRequest, TaskType, VoiceClonePrompt
from stages.prompts import build_live_prompt, build_prompt
from stages.talker.layout import max_frames_that_fit, prefill_length, trailing_length


@dataclass(frozen=True)
class VoiceChoice:
    """What voice a request uses: a preset speaker, an uploaded voice, the request's own clip, or none."""

    speaker: str | None = None
    uploaded: VoiceRecord | None = None
    inline: bool = False


def resolve_model_name(requested: str, names: dict[str, str]) -> str:
    """`model` of a request -> served model name; `names` maps lower-cased names and aliases to names."""
    name = names.get(requested.lower())
    if name is None:
        served = sorted(set(names.values()))
        raise APIError(404, f"model {shown(requested)} is not served here; served models: {served}", param="model",
                       code="model_not_found")
    return name


def infer_model(body: SpeechRequest, infos: dict[str, ModelInfo], find_voice, aliases: dict[str, str] | None = None,
                ) -> str:
    """The one served model that fits a request without `model`; 400 when none or several fit.

    `find_voice(name) -> VoiceRecord | None` looks up uploaded voices.
    """
    if len(infos) == 1:
        return next(iter(infos))
    task = _requested_task(body, infos, find_voice, aliases or {})
    fits = [n for n, i in infos.items()
            if (task is None or i.task is task) and _voice_fits(body, i, find_voice, aliases)]
    if len(fits) == 1:
        return fits[0]
    raise bad_request(f"`model` is required: {len(fits) or 'no'} served models fit this request "
                      f"(served: {sorted(infos)})", "model", code="model_required")


def _requested_task(body: SpeechRequest, infos: dict[str, ModelInfo], find_voice,
                    aliases: dict[str, str]) -> TaskType | None:
    if body.task_type:
        return TaskType(body.task_type)
    if body.ref_audio or body.ref_text or (body.voice and find_voice(body.voice)):
        return TaskType.BASE
    if body.voice and any(body.voice.lower() in i.speakers or alias_target(body.voice, aliases, i.speakers)
                          for i in infos.values()):
        return TaskType.CUSTOM_VOICE
    if body.instructions and not body.voice:
        return TaskType.VOICE_DESIGN
    return None


def _voice_fits(body: SpeechRequest, info: ModelInfo, find_voice, aliases: dict[str, str] | None) -> bool:
    try:
        choose_voice(body, info, find_voice, aliases)
    except APIError:
        return False
    return True


def choose_voice(body: SpeechRequest, info: ModelInfo, find_voice, aliases: dict[str, str] | None = None,
                 ) -> VoiceChoice:
    """`aliases`: other names of preset speakers (`ingress.voice_aliases`: OpenAI's voice names)."""
    task = info.task
    if body.task_type and body.task_type != task.value:
        raise bad_request(f"model {info.name!r} is a {task.value} checkpoint and cannot do task_type "
                          f"{body.task_type}", "task_type", code="unsupported_task")
    voice = (body.voice or "").strip()
    is_default = voice.lower() in ("", C.DEFAULT_VOICE_NAME)
    if task is not TaskType.BASE:
        if body.ref_audio:
            raise bad_request(f"ref_audio is only valid for Base (voice clone) models; {info.name!r} is "
                              f"{task.value}", "ref_audio", code="unsupported_task")
        if body.ref_text:
            raise bad_request("ref_text is only valid for Base (voice clone) models", "ref_text",
                              code="unsupported_task")
    if task is TaskType.CUSTOM_VOICE:
        if is_default:
            return VoiceChoice(speaker="vivian" if "vivian" in info.speakers else info.speakers[0])
        if voice.lower() in info.speakers:
            return VoiceChoice(speaker=voice.lower())
        if (speaker := alias_target(voice, aliases or {}, info.speakers)) is not None:
            return VoiceChoice(speaker=speaker)
        if find_voice(voice) is not None:
            raise bad_request(f"voice {shown(voice)} is an uploaded clone voice; it needs a Base model, and "
                              f"{info.name!r} is CustomVoice", "voice", code="unsupported_task")
        raise bad_request(f"unknown voice {shown(voice)} for {info.name!r}; supported: {info.speakers}", "voice",
                          code="voice_not_found")
    if task is TaskType.VOICE_DESIGN:
        if not is_default:
            raise bad_request(f"VoiceDesign models have no preset voices (got {shown(voice)}); describe the voice in "
                              f"`instructions` and omit voice or use {C.DEFAULT_VOICE_NAME!r}", "voice",
                              code="voice_not_found")
        if not (body.instructions or "").strip():
            raise bad_request("VoiceDesign needs `instructions` describing the voice", "instructions")
        return VoiceChoice()
    # Base: the request's own clip, or an uploaded voice
    if body.ref_audio:
        if not is_default:
            raise bad_request("give either `voice` (an uploaded voice) or `ref_audio`, not both", "voice")
        if not body.x_vector_only_mode and not (body.ref_text or "").strip():
            raise bad_request("voice cloning from ref_audio needs `ref_text` (its transcript) unless "
                              "x_vector_only_mode is true", "ref_text")
        return VoiceChoice(inline=True)
    if is_default:
        raise bad_request(f"Base model {info.name!r} needs a voice: `ref_audio` (+ `ref_text`) or the name of an "
                          "uploaded voice (POST /v1/audio/voices)", "voice")
    record = find_voice(voice)
    if record is None:
        raise bad_request(f"unknown voice {shown(voice)}: no uploaded voice has this name", "voice", code="voice_not_found")
    if body.ref_text:
        raise bad_request("ref_text applies to ref_audio; an uploaded voice has its own transcript", "ref_text")
    return VoiceChoice(uploaded=record)


def check_limits(body: SpeechRequest, limits: IngressConfig, live: bool = False) -> None:
    """Size limits and server switches, checked before anything costly happens. A live request (WebSocket
    context) may open without text: its text comes later (`check_live_text`)."""
    for field, limit in (("input", limits.max_input_chars), ("instructions", limits.max_instructions_chars),
                         ("ref_text", limits.max_ref_text_chars)):
        value = getattr(body, field) or ""
        if len(value) > limit:
            raise bad_request(f"{field} is {len(value)} characters; the limit is {limit}", field,
                              code="input_too_long")
    if not live and not body.input.strip():
        raise bad_request("input text is empty", "input", code="empty_input")
    if body.suppress_eos and not limits.allow_suppress_eos:
        raise bad_request("suppress_eos is disabled on this server", "suppress_eos")


def check_live_text(total_chars: int, limits: IngressConfig) -> None:
    """A live context's text so far (all its pieces) within `max_input_chars`."""
    if total_chars > limits.max_input_chars:
        raise bad_request(f"the context's text would be {total_chars} characters; the limit is "
                          f"{limits.max_input_chars}", "text", code="input_too_long")


def text_positions_error(max_text_rows: int) -> APIError:
    return bad_request(f"input text too long: more than {max_text_rows} text positions (tokens) in one utterance "
                       "for this model; split it", "input",
                       code="input_too_long")


def check_request(body: SpeechRequest, info: ModelInfo, args: TTSServingArgs) -> SamplingParams:
    """Everything about a request that needs the model but not its voice: lengths, chunking, sampling.

    Pure and fast, so it runs before the request's deadline starts to matter (a tiny `timeout_s` must
    not turn a 400 into a 504). -> the request's sampling parameters.
    """
    limit = min(args.ingress.max_new_tokens_limit or info.max_seq_len, info.max_seq_len)
    if body.max_new_tokens is not None and body.max_new_tokens > limit:
        raise bad_request(f"max_new_tokens {body.max_new_tokens} is above this model's limit {limit}",
                          "max_new_tokens", code="max_new_tokens_too_large")
    steady = args.streaming.schedule().steady_chunk_frames
    if body.initial_codec_chunk_frames is not None and body.initial_codec_chunk_frames > steady:
        raise bad_request(f"initial_codec_chunk_frames must be <= {steady} (the steady chunk size)",
                          "initial_codec_chunk_frames")
    sampling = dataclasses.replace(info.generation.sampling, **body.sampling_overrides())
    try:
        sampling.validate()
    except InvalidRequestError as e:
        raise bad_request(str(e)) from None
    return sampling


def build_request(
    body: SpeechRequest, info: ModelInfo, choice: VoiceChoice, voice: VoiceClonePrompt | None,
    args: TTSServingArgs, request_id: str, live: bool = False, idle_timeout_s: float | None = None,
    priority: Priority = Priority.REALTIME,
) -> tuple[SynthesisRequest, GenerateOptions]:
    """The engine's request. Its length is checked here against the model's `max_seq_len` (prompt
    positions + frames), so a request that cannot fit is a 400 from the ingress, never an exception
    (and a logged traceback) in the Talker.

    `live`: a request whose text arrives while it runs (`Talker.generate_live_many`): its prompt has no text and
    the streaming-text layout, whose length does not depend on the text."""
    sampling = check_request(body, info, args)
    if voice is not None and body.x_vector_only_mode and voice.icl:
        voice = VoiceClonePrompt(x_vector=voice.x_vector)
    kw = dict(task=info.task, speaker=choice.speaker, language=body.language, instruct=body.instructions, voice=voice)
    try:
        if live:
            prompt = build_live_prompt(info.config, info.tokenizer, **kw)
        else:
            prompt = build_prompt(info.config, info.tokenizer, body.input, **kw)
    except InvalidRequestError as e:
        raise bad_request(str(e)) from None
    if not live and trailing_length(prompt) > info.max_text_rows:  # the engine's rule, answered here
        raise text_positions_error(info.max_text_rows)

    # a live prompt's length is that of any text in its layout: one placeholder id sizes it
    prompt_len = prefill_length(dataclasses.replace(prompt, text_ids=(0,)) if live else prompt)
    room = max_frames_that_fit(prompt_len, info.max_seq_len)  # the engine's KV-fit rule (stages/talker/layout.py)
    if body.max_new_tokens is not None:
        if body.max_new_tokens > room:
            raise bad_request(f"request too long: a prompt of {prompt_len} positions + {body.max_new_tokens} frames "
                              f"exceeds the model's max_seq_len {info.max_seq_len}; at most {room} frames "
                              "fit", "max_new_tokens", code="request_too_long")
        max_frames = body.max_new_tokens
    else:
        limit = min(args.ingress.max_new_tokens_limit or info.max_seq_len, info.default_max_new_tokens)
        max_frames = min(limit, room)
        # a long prompt (e.g. a Base reference clip in ICL mode) may leave room for a frame or two: that is
        # a useless 80 ms answer with finish_reason=length, so it is refused instead
        floor = min(args.ingress.min_fitted_frames, limit)
        if max_frames < floor:
            raise bad_request(f"request too long: a prompt of {prompt_len} positions leaves room for {room} "
                              f"frames within the model's max_seq_len {info.max_seq_len}; at least {floor} are "
                              "needed (shorten the input or the reference clip)", "input", code="request_too_long")
    request = SynthesisRequest(request_id=request_id, prompt=prompt, sampling=sampling, max_frames=max_frames,
                               seed=body.seed, priority=priority)
    options = GenerateOptions(first_chunk_frames=body.initial_codec_chunk_frames, text_idle_timeout_s=idle_timeout_s)
    return request, options
