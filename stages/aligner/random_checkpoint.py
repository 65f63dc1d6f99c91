"""Writes random-weight Qwen3-ForcedAligner checkpoints in the official Hugging Face layout.

No weights can be downloaded in our workplaces, so tests, the embedded default and GPU benchmarks run on checkpoints
written here: the Qwen3-ForcedAligner-0.6B shapes, or `tiny` ones (a second to build on a CPU). They load with our
loader and with the official `qwen-asr` (tests/stages/test_aligner_parity.py).

    python -m stages.aligner.random_checkpoint OUT [--tiny] [--dtype bfloat16] [--device cpu] [--seed 0]

The tokenizer is the project's test tokenizer (stages/random_checkpoint.py): byte-level, one id per byte, with the
special tokens the aligner's prompt uses at their real ids.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from stages.aligner.config import AlignerConfig
from stages.aligner.model import ForcedAligner
from stages.checkpoint import parse_dtype
from stages.random_checkpoint import _byte_alphabet

FIRST_SPECIAL_ID = 151643
# Qwen2 added tokens from 151643 in order, up to the aligner's <|audio_pad|> (151676) and <timestamp> (151705); the
# ids between that the aligner never uses are filled with reserved names
NAMED_SPECIAL = {
    **{FIRST_SPECIAL_ID + i: t for i, t in enumerate((
        "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
        "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|> "
        "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> "
        "<|file_sep|> <tool_response> </tool_response> <think> </think> <|audio_start|> <|audio_end|>").split())},
    151676: "<|audio_pad|>",
    151705: "<timestamp>",
}
LAST_SPECIAL_ID = 151705


def aligner_config(tiny: bool) -> dict[str, Any]:
    """config.json of Qwen3-ForcedAligner-0.6B (or the same layout with tiny shapes)."""
    audio = dict(num_mel_bins=128, d_model=1024, encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096,
                 output_dim=1024, downsample_hidden_size=480, n_window=50, n_window_infer=800,
                 max_source_positions=1500, activation_function="gelu", scale_embedding=False, dropout=0.0,
                 attention_dropout=0.0, activation_dropout=0.0, conv_chunksize=500, model_type="qwen3_asr_audio_encoder")
    text = dict(vocab_size=152064, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_act="silu",
                max_position_embeddings=65536, rms_norm_eps=1e-6, rope_theta=1000000.0, attention_bias=False,
                attention_dropout=0.0, tie_word_embeddings=False, use_cache=True,
                rope_scaling={"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default",
                              "type": "default"}, model_type="qwen3_asr_text")
    if tiny:
        # n_window_infer 200: blocks of two windows, so that a few seconds of audio span several attention blocks
        audio.update(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, output_dim=32,
                     downsample_hidden_size=8, n_window_infer=200)
        text.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8,
                    rope_scaling={"interleaved": True, "mrope_section": [2, 1, 1], "rope_type": "default",
                                  "type": "default"})
    thinker = dict(model_type="qwen3_forced_aligner", audio_config=audio, text_config=text, classify_num=5000,
                   audio_token_id=151676, audio_start_token_id=151669, audio_end_token_id=151670, user_token_id=872,
                   pad_token_id=151643, tie_word_embeddings=False, initializer_range=0.02)
    return dict(architectures=["Qwen3ASRForConditionalGeneration"], model_type="qwen3_asr", thinker_config=thinker,
                timestamp_token_id=151705, timestamp_segment_time=80, tie_word_embeddings=False,
                support_languages=["Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese",
                                   "Korean", "Portuguese", "Russian", "Spanish"])


PREPROCESSOR_CONFIG = dict(
    feature_extractor_type="WhisperFeatureExtractor", processor_class="Qwen3ASRProcessor", feature_size=128,
    sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400, n_samples=480000, nb_max_frames=3000,
    padding_side="right", padding_value=0.0, return_attention_mask=True, dither=0.0,
)


def randomize_(model: ForcedAligner, generator: torch.Generator, std: float = 0.02, head_std: float = 0.5) -> None:
    """N(0, std) weights and biases of every Linear/Embedding/Conv (nonzero biases reach the official padding
    quirks of the audio tower), norms at one; the timestamp head wider (`head_std`), so that its argmax stands clear
    of rounding and the timestamps are a stable function of the weights."""
    with torch.no_grad():
        for sub in model.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding, nn.Conv2d)):
                scale = head_std if sub is model.lm_head else std
                sub.weight.copy_(torch.randn(sub.weight.shape, generator=generator, device=sub.weight.device) * scale)
                if getattr(sub, "bias", None) is not None:
                    sub.bias.copy_(torch.randn(sub.bias.shape, generator=generator, device=sub.bias.device) * std)


def write_tokenizer(out: Path) -> None:
    """Byte-level BPE without merges (one id per byte, Qwen2's byte alphabet) and the added tokens at their real
    ids; `extra_special_tokens` names the audio tokens as the official processor reads them."""
    vocab = {ch: i for i, ch in enumerate(_byte_alphabet().values())}
    vocab.update({f"<|unused_{i}|>": i for i in range(256, FIRST_SPECIAL_ID)})
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    added = {
        str(i): dict(content=NAMED_SPECIAL.get(i, f"<|aligner_reserved_{i}|>"), lstrip=False, normalized=False,
                     rstrip=False, single_word=False, special=True)
        for i in range(FIRST_SPECIAL_ID, LAST_SPECIAL_ID + 1)
    }
    config = dict(
        tokenizer_class="Qwen2Tokenizer", added_tokens_decoder=added, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, model_max_length=131072, errors="replace", clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        extra_special_tokens={"audio_token": "<|audio_pad|>", "audio_bos_token": "<|audio_start|>",
                              "audio_eos_token": "<|audio_end|>"},
    )
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")


def write_random_aligner(out: str | Path, *, tiny: bool = False, dtype: str = "bfloat16", device: str = "cpu",
                         seed: int = 0, log=print) -> Path:
    t0 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = aligner_config(tiny)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        model = ForcedAligner(AlignerConfig.from_dict(cfg))
    # tiny: wider weights than the real init, so that the few tiny layers move the prediction at each timestamp slot
    # away from what the slot's embedding alone gives (else every word gets the same time)
    randomize_(model, generator, std=0.3 if tiny else 0.02)
    torch_dtype = parse_dtype(dtype)
    tensors = {f"thinker.{k}": v.to(torch_dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=1))
    write_tokenizer(out)
    log(f"[aligner checkpoint] {out} complete ({'tiny' if tiny else '0.6B'}, {dtype}) in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m stages.aligner.random_checkpoint", description=__doc__)
    parser.add_argument("out")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes for CPU tests and the embedded default")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_random_aligner(args.out, tiny=args.tiny, dtype=args.dtype, device=args.device, seed=args.seed)


if __name__ == "__main__":
    main()
