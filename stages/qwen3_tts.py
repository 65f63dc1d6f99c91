"""A loaded Qwen3-TTS checkpoint: configs, tokenizer and every module, on one device and dtype."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stages.checkpoint import load_module_strict, parse_dtype, resolve_checkpoint
from stages.code2wav.config import DecoderConfig
from stages.code2wav.model import Code2WavDecoder
from stages.config import GenerationDefaults, ModelConfig
from stages.prompts import TextTokenizer
from stages.talker.model import Talker
from stages.voice.loading import load_voice_encoders
from stages.voice.reference_encoder import ReferenceAudioEncoder
from stages.voice.speaker_encoder import SpeakerEncoder


@dataclass
class Qwen3TTS:
    """Everything of one checkpoint. Parts a deployment does not need can be skipped at load."""

    path: Path
    config: ModelConfig
    generation: GenerationDefaults
    device: torch.device
    dtype: torch.dtype
    tokenizer: TextTokenizer | None
    talker: Talker | None
    decoder: Code2WavDecoder | None
    speaker_encoder: SpeakerEncoder | None
    reference_encoder: ReferenceAudioEncoder | None
    codec_config: dict[str, Any]

    @classmethod
    def load(
        cls,
        path_or_id: str | Path,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "bfloat16",
        *,
        talker: bool = True,
        decoder: bool = True,
        voice: bool = True,
        log=None,
    ) -> Qwen3TTS:
        """Load what is asked for (talker + tokenizer, codec decoder, voice-clone encoders).

        `log` (a callable taking a string) receives progress lines with timings.
        """
        t0 = time.perf_counter()
        say = log or (lambda _msg: None)
        root = resolve_checkpoint(path_or_id)
        device, dtype = torch.device(device), parse_dtype(dtype)
        config = ModelConfig.from_file(root / "config.json")
        codec_config = json.loads((root / "speech_tokenizer" / "config.json").read_text(encoding="utf-8"))
        main_file, codec_file = root / "model.safetensors", root / "speech_tokenizer" / "model.safetensors"
        model = cls(
            path=root, config=config, generation=GenerationDefaults.from_file(root / "generation_config.json"),
            device=device, dtype=dtype, tokenizer=None, talker=None, decoder=None, speaker_encoder=None,
            reference_encoder=None, codec_config=codec_config,
        )
        # tensors of parts we do not build (e.g. the speaker encoder when voice=False) are tolerated
        main_skips = ("speaker_encoder.",)
        if talker:
            model.tokenizer = TextTokenizer(root)
            with torch.device("meta"):
                module = Talker(config.talker)
            model.talker = load_module_strict(module, main_file, "talker.", device, dtype, skip_prefixes=main_skips)
            say(f"talker loaded ({_count(model.talker) / 1e6:.1f} M params) in {time.perf_counter() - t0:.1f} s")
        if decoder:
            with torch.device("meta"):
                module = Code2WavDecoder(DecoderConfig.from_dict(codec_config["decoder_config"]))
            model.decoder = load_module_strict(module, codec_file, "decoder.", device, dtype,
                                               skip_prefixes=("encoder.",))
            say(f"code2wav decoder loaded in {time.perf_counter() - t0:.1f} s")
        if voice and config.model_kind == "base":
            model.speaker_encoder, model.reference_encoder = load_voice_encoders(
                config, codec_config, main_file, codec_file, device, dtype
            )
            say(f"voice encoders loaded in {time.perf_counter() - t0:.1f} s")
        return model


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
