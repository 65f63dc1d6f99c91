"""Text side of a request: the checkpoint's tokenizer, the official templates, validation -> TalkerPrompt.

Templates (official wrapper): target `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`
(role = first 3 ids, text = ids[3:-5]); instruction `<|im_start|>user\\n{instruct}<|im_end|>\\n` (all ids);
ICL reference transcript `<|im_start|>assistant\\n{ref_text}<|im_end|>\\n` (ids[3:-2]). Each template is
tokenized whole, as the official code does, so BPE merges across the boundaries are identical.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from stages.config import ModelConfig
from stages.contract import InvalidRequestError, TalkerPrompt, TaskType, VoiceClonePrompt
from stages.text_tokenizer import load_qwen2_tokenizer


class TextTokenizer:
    """The checkpoint's own Qwen2 BPE tokenizer (vocab.json, merges.txt, tokenizer_config.json).

    Built with the `tokenizers` library (stages/text_tokenizer.py), not transformers: it travels pickled to
    the CPU ingress, which tokenizes requests without importing transformers.
    """

    def __init__(self, checkpoint_dir: str | Path):
        self._tok = load_qwen2_tokenizer(checkpoint_dir)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_words(self, text: str) -> tuple[list[int], list[int | None], list[tuple[int, int]]]:
        """-> (ids, the pre-tokenizer word of each id, each id's character offsets): where live text may be cut
        (stages/text_stream.py)."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.word_ids, enc.offsets

    def added_tokens(self) -> list[str]:
        """The texts of the added (special) tokens, e.g. `<|im_start|>`."""
        return [t.content for t in self._tok.get_added_tokens_decoder().values()]

    def target_ids(self, text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """-> (role ids, text ids) of the target template."""
        ids = self.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
        return tuple(ids[:3]), tuple(ids[3:-5])

    def instruct_ids(self, instruct: str) -> tuple[int, ...]:
        return tuple(self.encode(f"<|im_start|>user\n{instruct}<|im_end|>\n"))

    def ref_text_ids(self, ref_text: str) -> tuple[int, ...]:
        return tuple(self.encode(f"<|im_start|>assistant\n{ref_text}<|im_end|>\n")[3:-2])


def infer_task(config: ModelConfig, requested: TaskType | str | None) -> TaskType:
    """The task a request asks for; a checkpoint serves exactly one task."""
    task = config.task
    if requested is None:
        return task
    try:
        requested = TaskType(requested)
    except ValueError:
        raise InvalidRequestError(
            f"unknown task_type {requested!r}; expected one of {[t.value for t in TaskType]}"
        ) from None
    if requested != task:
        raise InvalidRequestError(f"this model is a {task.value} checkpoint and cannot do task_type {requested.value}")
    return task


def resolve_language(config: ModelConfig, language: str | None, speaker: str | None) -> int | None:
    """Language name -> codec id (None = auto), applying the official dialect rule."""
    lang = (language or "auto").strip().lower()
    if lang != "auto" and lang not in config.public_languages:
        raise InvalidRequestError(f"unsupported language {language!r}; supported: {config.public_languages}")
    language_id = None if lang == "auto" else config.talker.languages[lang]
    dialect = config.talker.speaker_dialects.get(speaker or "")
    if dialect and lang in ("chinese", "auto"):
        language_id = config.talker.languages[dialect]
    return language_id


def build_prompt(
    config: ModelConfig,
    tokenizer: TextTokenizer,
    text: str,
    *,
    task: TaskType | str | None = None,
    speaker: str | None = None,
    language: str | None = None,
    instruct: str | None = None,
    voice: VoiceClonePrompt | None = None,
    non_streaming_text: bool | None = None,
) -> TalkerPrompt:
    """Validate a request against the checkpoint and tokenize it.

    `non_streaming_text=None` takes the official default of the task (CustomVoice/VoiceDesign: True,
    Base: False).
    """
    task = infer_task(config, task)
    if not text or not text.strip():
        raise InvalidRequestError("input text is empty")
    prompt = _prompt_without_text(config, tokenizer, task, speaker, language, instruct, voice)
    role_ids, text_ids = tokenizer.target_ids(text)
    if not text_ids:
        raise InvalidRequestError("input text tokenizes to nothing")
    if non_streaming_text is None:
        non_streaming_text = task is not TaskType.BASE
    return replace(prompt, text_ids=text_ids, role_ids=role_ids, non_streaming_text=non_streaming_text)


def build_live_prompt(
    config: ModelConfig,
    tokenizer: TextTokenizer,
    *,
    task: TaskType | str | None = None,
    speaker: str | None = None,
    language: str | None = None,
    instruct: str | None = None,
    voice: VoiceClonePrompt | None = None,
) -> TalkerPrompt:
    """A prompt whose text arrives later (`TalkerEngine.open_request`): validated like `build_prompt`, no text
    ids, and the streaming-text layout (the only one that can start before the text is complete) for every task."""
    return _prompt_without_text(config, tokenizer, infer_task(config, task), speaker, language, instruct, voice)


def _prompt_without_text(
    config: ModelConfig, tokenizer: TextTokenizer, task: TaskType, speaker: str | None, language: str | None,
    instruct: str | None, voice: VoiceClonePrompt | None,
) -> TalkerPrompt:
    speaker_key = speaker.strip().lower() if speaker else None
    speaker_id = None
    if task is TaskType.CUSTOM_VOICE:
        if not speaker_key:
            raise InvalidRequestError(f"CustomVoice needs a speaker (voice); supported: {sorted(config.talker.speakers)}")
        if speaker_key not in config.talker.speakers:
            raise InvalidRequestError(f"unknown speaker {speaker!r}; supported: {sorted(config.talker.speakers)}")
        speaker_id = config.talker.speakers[speaker_key]
    elif speaker_key:
        raise InvalidRequestError(f"{task.value} models have no preset speakers (got {speaker!r})")

    if task is TaskType.BASE:
        if voice is None:
            raise InvalidRequestError("Base (voice clone) needs a reference voice: ref_audio or an uploaded voice")
        if voice.icl and not voice.ref_text_ids:
            raise InvalidRequestError("ICL voice cloning needs the reference transcript (ref_text)")
    elif voice is not None:
        raise InvalidRequestError(f"{task.value} models cannot clone a reference voice")

    instruct_ids = None
    if instruct:
        if not config.accepts_instruction:
            if task is TaskType.BASE:
                raise InvalidRequestError("Base models take no instructions")
            instruct = None  # 0.6B CustomVoice: the official wrapper drops it silently; so do we
        if instruct:
            instruct_ids = tokenizer.instruct_ids(instruct)
    return TalkerPrompt(
        text_ids=(),
        language_id=resolve_language(config, language, speaker_key),
        speaker_id=speaker_id,
        instruct_ids=instruct_ids,
        voice=voice,
        non_streaming_text=False,
    )
