"""Random voice-clone front ends for the random-checkpoint writer (stages/random_checkpoint.py)."""

from __future__ import annotations

from typing import Any

import torch

from stages.voice.config import ReferenceEncoderConfig, SpeakerEncoderConfig
from stages.voice.reference_encoder import ReferenceAudioEncoder, randomize_codebooks_
from stages.voice.speaker_encoder import SpeakerEncoder, randomize_speaker_encoder_


def build_random_speaker_encoder(config: dict[str, Any], generator: torch.Generator, device: str) -> SpeakerEncoder:
    with torch.device(device):
        encoder = SpeakerEncoder(SpeakerEncoderConfig.from_dict(config))
    randomize_speaker_encoder_(encoder, generator)
    return encoder


def build_random_reference_encoder(codec_config: dict[str, Any], generator: torch.Generator,
                                   device: str) -> ReferenceAudioEncoder:
    """The Mimi encoder half with non-degenerate codebooks.

    Codebook scale: random SEANet latents are far from N(0, 1) at every size, so the codewords are
    drawn at the latents' own scale (measured once on a probe signal) to spread the codes. The scale is rounded
    to two significant digits: the probe's float sums depend on the thread count (and the CPU's vector width),
    and an unrounded scale carried those last bits into the bf16 codebooks, so one seed could write two files.
    """
    with torch.device(device):
        encoder = ReferenceAudioEncoder(ReferenceEncoderConfig.from_dict(codec_config))
    probe = torch.sin(torch.linspace(0, 400.0, 24000, device=device)) * 0.5
    with torch.no_grad():
        latents = encoder.encoder(probe[None, None])
        scale = float(f"{float(latents.float().std().clamp(min=1e-3)):.2g}")
    randomize_codebooks_(encoder, generator, std=scale)
    return encoder
