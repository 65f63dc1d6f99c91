"""Reference clip (+ transcript) -> VoiceClonePrompt: x-vector, reference codes, transcript ids."""

from __future__ import annotations

import numpy as np
import torch

from stages.contract import InvalidRequestError, VoiceClonePrompt
from stages.qwen3_tts import Qwen3TTS
from stages.voice.audio import AudioInput, load_reference_audio


def create_voice_clone_prompt(
    model: Qwen3TTS, audio: AudioInput, ref_text: str | None = None, x_vector_only: bool = False,
    max_seconds: float | None = 60.0,
) -> VoiceClonePrompt:
    """The official `create_voice_clone_prompt` for one clip (audio resampled to 24 kHz).

    ICL mode (the default) needs the transcript; x-vector-only mode ignores it.
    """
    if model.config.model_kind != "base":
        raise InvalidRequestError(f"voice cloning needs a Base checkpoint; this one is {model.config.model_kind}")
    if model.speaker_encoder is None or model.reference_encoder is None:
        raise ValueError("the model was loaded without its voice encoders (voice=False)")
    if not x_vector_only and not (ref_text and ref_text.strip()):
        raise InvalidRequestError("ref_text is required for in-context voice cloning (or set x_vector_only_mode)")
    try:
        wav = load_reference_audio(audio, max_seconds=max_seconds)
    except ValueError as e:
        raise InvalidRequestError(str(e)) from e
    samples = torch.from_numpy(wav).to(model.device)
    x_vector = model.speaker_encoder.embed(samples).float().cpu().numpy()
    if x_vector_only:
        return VoiceClonePrompt(x_vector=x_vector)
    codes = model.reference_encoder.encode(samples).cpu().numpy().astype(np.int64)
    assert model.tokenizer is not None
    return VoiceClonePrompt(x_vector=x_vector, ref_codes=codes, ref_text_ids=model.tokenizer.ref_text_ids(ref_text))
