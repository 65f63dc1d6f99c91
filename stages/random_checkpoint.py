"""Writes random-weight Qwen3-TTS checkpoints in the exact Hugging Face layout of the releases.

No weights can be downloaded in our workplaces, so tests, the embedded default and GPU benchmarks
run on checkpoints written here: full size (real shapes of every released variant) or `tiny`
(seconds to build on a CPU). The files load with our loader and with the official `qwen-tts`.

    python -m stages.checkpoint random OUT --size 0.6b|1.7b --kind custom_voice|base|voice_design \
        [--tiny] [--dtype bfloat16] [--device cpu] [--seed 0]
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from stages.checkpoint import parse_dtype
from stages.code2wav.config import DecoderConfig
from stages.code2wav.model import Code2WavDecoder, randomize_codebooks_
from stages.config import ModelConfig
from stages.talker.model import Talker
from stages.voice.random_init import build_random_reference_encoder, build_random_speaker_encoder

LANGUAGES = {"chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
             "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069}
DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKERS = {"serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861, "ono_anna": 2873,
            "sohee": 2864, "eric": 2875, "dylan": 2878}
SPEAKER_DIALECT = {"eric": "sichuan_dialect", "dylan": "beijing_dialect"}
# Qwen2/Qwen3 added tokens, ids 151643.. in order (the TTS ones are 151671..151675)
SPECIAL_TOKENS = (
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> "
    "<tool_response> </tool_response> <think> </think> <|audio_start|> <|audio_end|> <tts_pad> <tts_text_bos> "
    "<tts_text_eod> <tts_text_bos_single> <|audio_pad|>"
).split()
FIRST_SPECIAL_ID = 151643
SIZES = {"0.6b": "0b6", "0b6": "0b6", "1.7b": "1b7", "1b7": "1b7"}
KINDS = ("custom_voice", "base", "voice_design")


def main_config(size: str, kind: str, tiny: bool) -> dict[str, Any]:
    size = SIZES[size]
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    if kind == "voice_design" and size == "0b6":
        raise ValueError("there is no 0.6B VoiceDesign release")
    hidden, ffn = (2048, 6144) if size == "1b7" else (1024, 3072)
    custom = kind == "custom_voice"
    code_predictor = dict(
        vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_theta=1000000, hidden_act="silu", num_code_groups=16,
    )
    talker = dict(
        vocab_size=3072, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000, hidden_act="silu", num_code_groups=16, text_hidden_size=2048,
        text_vocab_size=151936, position_id_per_seconds=13,
        rope_scaling={"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default", "type": "default"},
        codec_bos_id=2149, codec_eos_token_id=2150, codec_pad_id=2148, codec_think_id=2154,
        codec_nothink_id=2155, codec_think_bos_id=2156, codec_think_eos_id=2157,
        codec_language_id={**LANGUAGES, **(DIALECTS if custom else {})},
        spk_id=dict(SPEAKERS) if custom else {},
        spk_is_dialect={k: SPEAKER_DIALECT.get(k, False) for k in SPEAKERS} if custom else {},
        code_predictor_config=code_predictor,
    )
    cfg = dict(
        architectures=["Qwen3TTSForConditionalGeneration"], model_type="qwen3_tts",
        tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size=size, tts_model_type=kind,
        assistant_token_id=77091, im_start_token_id=151644, im_end_token_id=151645, tts_pad_token_id=151671,
        tts_bos_token_id=151672, tts_eos_token_id=151673, talker_config=talker,
    )
    if kind == "base":
        cfg["speaker_encoder_config"] = {"enc_dim": hidden, "sample_rate": 24000}
    if tiny:
        # as in the releases, the 0.6B talker is as wide as its code predictor (an Identity
        # small_to_mtp_projection) and the 1.7B one twice as wide (a Linear projection)
        tiny_hidden = 64 if size == "1b7" else 32
        talker.update(hidden_size=tiny_hidden, intermediate_size=2 * tiny_hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, text_hidden_size=32,
                      rope_scaling={"interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default",
                                    "type": "default"})
        code_predictor.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=8)
        if kind == "base":
            cfg["speaker_encoder_config"] = {"enc_dim": tiny_hidden, "sample_rate": 24000,
                                             "enc_channels": [32, 32, 32, 32, 96], "enc_attention_channels": 16,
                                             "enc_se_channels": 16}
    return cfg


def codec_config(tiny: bool) -> dict[str, Any]:
    encoder = dict(
        audio_channels=1, num_filters=64, kernel_size=7, residual_kernel_size=3, last_kernel_size=3,
        num_residual_layers=1, compress=2, upsampling_ratios=[8, 6, 5, 4], hidden_size=512, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=8, head_dim=64, intermediate_size=2048, hidden_act="gelu",
        norm_eps=1e-5, layer_scale_initial_scale=0.01, rope_theta=10000, max_position_embeddings=8000,
        sliding_window=250, num_quantizers=32, num_semantic_quantizers=1, codebook_size=2048, codebook_dim=256,
        vector_quantization_hidden_dimension=256, pad_mode="constant", use_causal_conv=True,
        sampling_rate=24000, frame_rate=12.5, dilation_growth_rate=2, trim_right_ratio=1.0, use_conv_shortcut=False,
        upsample_groups=512,
    )
    decoder = dict(
        latent_dim=1024, codebook_dim=512, codebook_size=2048, decoder_dim=1536, hidden_size=512,
        intermediate_size=1024, hidden_act="silu", num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16, head_dim=64, rms_norm_eps=1e-5, layer_scale_initial_scale=0.01, rope_theta=10000,
        max_position_embeddings=8000, sliding_window=72, num_quantizers=16, num_semantic_quantizers=1,
        semantic_codebook_size=4096, upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2],
        vector_quantization_hidden_dimension=512, attention_bias=False, attention_dropout=0.0,
    )
    if tiny:
        encoder.update(hidden_size=32, num_filters=8, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=16, intermediate_size=64, codebook_dim=16,
                       vector_quantization_hidden_dimension=16, upsample_groups=32)
        decoder.update(latent_dim=64, codebook_dim=32, decoder_dim=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                       vector_quantization_hidden_dimension=32)
    return dict(
        architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz",
        encoder_valid_num_quantizers=16, input_sample_rate=24000, output_sample_rate=24000,
        decode_upsample_rate=1920, encode_downsample_rate=1920, encoder_config=encoder, decoder_config=decoder,
    )


GENERATION_CONFIG = dict(
    do_sample=True, repetition_penalty=1.05, temperature=0.9, top_p=1.0, top_k=50, subtalker_dosample=True,
    subtalker_temperature=0.9, subtalker_top_p=1.0, subtalker_top_k=50, max_new_tokens=8192,
)
PREPROCESSOR_CONFIG = dict(
    feature_extractor_type="EncodecFeatureExtractor", feature_size=1, sampling_rate=24000, padding_side="right",
    padding_value=0.0, return_attention_mask=True, chunk_length_s=None, overlap=None,
)


def init_like_hf_(module: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """N(0, std) for Linear/Embedding/Conv weights, zero biases (Hugging Face's default init)."""
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding, nn.Conv1d, nn.ConvTranspose1d)):
                w = sub.weight
                w.copy_(torch.randn(w.shape, generator=generator, device=w.device, dtype=torch.float32).to(w.dtype) * std)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.zero_()


def _byte_alphabet() -> dict[int, str]:
    """GPT-2/Qwen2 byte-level BPE alphabet in vocabulary order: printable bytes (as themselves) first,
    then the other bytes in byte order, mapped to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _write_text_tokenizer(out: Path) -> None:
    """A byte-level BPE with Qwen2's byte alphabet and the real special/structural ids.

    The real 151k-entry vocabulary cannot be fetched offline; this one maps every byte to its Qwen2
    id (so "\\n" is 198) and merges exactly the words the templates need: "assistant" -> 77091,
    "user" -> 872, "system" -> 8948. Unused ids are filled so that the vocabulary has the real size.
    """
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet().values())}
    merges: list[str] = []
    next_free = 150000
    for word, word_id in {"assistant": 77091, "user": 872, "system": 8948}.items():
        current = word[0]
        for ch in word[1:]:
            merges.append(f"{current} {ch}")
            current += ch
            if current not in vocab:
                vocab[current] = word_id if current == word else next_free
                next_free += current != word
    used = set(vocab.values())
    vocab.update({f"<|unused_{i}|>": i for i in range(256, FIRST_SPECIAL_ID) if i not in used})
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {
        str(FIRST_SPECIAL_ID + i): dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False,
                                        special=True)
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = dict(
        tokenizer_class="Qwen2Tokenizer", added_tokens_decoder=added, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", bos_token=None, unk_token=None, model_max_length=131072, errors="replace",
        clean_up_tokenization_spaces=False, split_special_tokens=False,
    )
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1), encoding="utf-8")


def _state(prefix: str, module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {prefix + k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
            for k, v in module.state_dict().items()}


@contextmanager
def _global_rng_seeded(seed: int, device: str) -> Iterator[None]:
    """PyTorch's global RNG (CPU, and `device`'s if it is an accelerator) seeded, restored on exit."""
    dev = torch.device(device)
    accelerator = [dev] if dev.type != "cpu" else []
    with torch.random.fork_rng(devices=accelerator, device_type=dev.type if accelerator else "cuda"):
        torch.manual_seed(seed)
        yield


def write_random_checkpoint(
    out: str | Path, size: str = "0.6b", kind: str = "custom_voice", *, tiny: bool = False,
    dtype: str = "bfloat16", device: str = "cpu", seed: int = 0, log=print,
) -> Path:
    t0 = time.perf_counter()
    out = Path(out)
    (out / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
    torch_dtype = parse_dtype(dtype)
    cfg, codec = main_config(size, kind, tiny), codec_config(tiny)
    # Weights the writer draws itself come from `gen`; the rest (PyTorch's default init of the codec's
    # convolutions, ...) from the global RNG, seeded here and restored afterwards, so the files are a
    # function of `seed` alone and the caller's random state is left as it was.
    with _global_rng_seeded(seed, device):
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.device(device):
            talker = Talker(ModelConfig.from_dict(cfg).talker)
        init_like_hf_(talker, gen)
        tensors = _state("talker.", talker, torch_dtype)
        del talker
        if kind == "base":
            speaker_encoder = build_random_speaker_encoder(cfg["speaker_encoder_config"], gen, device)
            tensors.update(_state("speaker_encoder.", speaker_encoder, torch_dtype))
            del speaker_encoder
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        log(f"[checkpoint] model.safetensors written ({time.perf_counter() - t0:.1f} s)")

        with torch.device(device):
            decoder = Code2WavDecoder(DecoderConfig.from_dict(codec["decoder_config"]))
        randomize_codebooks_(decoder, gen)
        codec_tensors = _state("decoder.", decoder, torch_dtype)
        del decoder
        encoder = build_random_reference_encoder(codec, gen, device)
        codec_tensors.update(_state("encoder.", encoder, torch_dtype))
        save_file(codec_tensors, str(out / "speech_tokenizer" / "model.safetensors"), metadata={"format": "pt"})
        log(f"[checkpoint] speech_tokenizer/model.safetensors written ({time.perf_counter() - t0:.1f} s)")

    # config.json is written from the dict (the official save_pretrained writes one it cannot re-read)
    (out / "config.json").write_text(json.dumps({**copy.deepcopy(cfg), "torch_dtype": dtype}, indent=1))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=1))
    (out / "speech_tokenizer" / "config.json").write_text(json.dumps({**codec, "torch_dtype": dtype}, indent=1))
    (out / "speech_tokenizer" / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    _write_text_tokenizer(out)
    log(f"[checkpoint] {out} complete ({size}, {kind}{', tiny' if tiny else ''}, {dtype}) "
        f"in {time.perf_counter() - t0:.1f} s")
    return out
