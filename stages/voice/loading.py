"""Loading the Base model's voice-clone front ends (speaker encoder, reference-audio encoder) strictly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from stages.checkpoint import load_module_strict
from stages.config import ModelConfig
from stages.voice.config import ReferenceEncoderConfig, SpeakerEncoderConfig
from stages.voice.reference_encoder import ReferenceAudioEncoder
from stages.voice.speaker_encoder import SpeakerEncoder


def load_voice_encoders(config: ModelConfig, codec_config: dict[str, Any], main_file: Path, codec_file: Path,
                        device: torch.device, dtype: torch.dtype) -> tuple[SpeakerEncoder, ReferenceAudioEncoder]:
    with torch.device("meta"):
        speaker = SpeakerEncoder(SpeakerEncoderConfig.from_dict(config.speaker_encoder))
    speaker = load_module_strict(speaker, main_file, "speaker_encoder.", device, dtype, skip_prefixes=("talker.",))
    # Mimi keeps non-persistent buffers (conv padding, RoPE), so it is built on the real device, not meta
    with torch.device(device):
        reference = ReferenceAudioEncoder(ReferenceEncoderConfig.from_dict(codec_config))
    reference = load_module_strict(reference, codec_file, "encoder.", device, dtype, skip_prefixes=("decoder.",))
    reference.reset_codebook_cache()
    return speaker, reference
