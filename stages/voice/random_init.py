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
    drawn at the latents' own scale (measured once on a probe signal) to spread the codes.
    """
    with torch.device(device):
        encoder = ReferenceAudioEncoder(ReferenceEncoderConfig.from_dict(codec_config))
    probe = torch.sin(torch.linspace(0, 400.0, 24000, device=device)) * 0.5
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.no_grad():
            latents = encoder.encoder(probe[None, None])
            scale = float(f"{float(latents.double().std().clamp(min=1e-3)):.3g}")
    finally:
        torch.set_num_threads(threads)
    randomize_codebooks_(encoder, generator, std=scale)
    return encoder
