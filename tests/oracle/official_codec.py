"""Oracle script (runs INSIDE the oracle venv): build a random official codec, save it, decode given codes.

Usage: python official_codec.py OUT_DIR SPEC_JSON

SPEC_JSON holds {"codec_config": {...}, "seed": int, "codes": {name: [B][16][T] ints},
                 "forward": [names], "decode": [names], "bf16": [names]}   (each list defaults to all names
but "bf16" to none); -1 marks padding frames (official `decode` convention; `forward` sees them as 0).

Writes:
  OUT_DIR/speech_tokenizer/{model.safetensors, config.json, preprocessor_config.json}
  OUT_DIR/official_decode.safetensors with
    "forward.<name>"      = model.decoder(codes.clamp(min=0))                    [B, 1, T * 1920]
    "decode.<name>.<i>"   = model.decode(codes.transpose(1, 2))[i]               [n_valid_frames_i * 1920]
                            (the official API: -1 padding, chunked_decode, 300-frame chunks, 25 context)
    "forward_bf16.<name>" = decoder of from_pretrained(dtype=bfloat16)(codes)    [B, 1, T * 1920] bf16
Prints a JSON summary on stdout.
"""

import json
import os
import sys

import official_import  # noqa: F401  (stubs torchaudio, imports qwen_tts offline)
import torch
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
from safetensors.torch import save_file

PREPROCESSOR = dict(
    feature_extractor_type="EncodecFeatureExtractor", feature_size=1, sampling_rate=24000, padding_side="right",
    padding_value=0.0, return_attention_mask=True, chunk_length_s=None, overlap=None,
)


def randomize(model: Qwen3TTSTokenizerV2Model, generator: torch.Generator) -> None:
    """Make the random codec a meaningful oracle.

    1. HF `post_init` draws decoder conv/linear weights with std 0.02, which shrinks the signal at every
       layer: the waveform comes out at ~1e-7, where any 1e-5 tolerance is vacuous. Re-draw them with
       PyTorch's default (fan-in scaled) init instead: waveform |x| ~ 0.1-0.3, no clamping.
    2. Research doc section 7 gotcha 5: default init zeroes codebooks (audio independent of codes) and
       makes ConvNeXt gamma / LayerScale branches negligible.
    """
    with torch.no_grad():
        for module in model.decoder.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.reset_parameters()
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("embedding_sum", "embed_sum")):
                p.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("cluster_usage"):
                p.fill_(1.0)
            elif name.endswith((".gamma", "layer_scale.scale")):
                p.fill_(0.1)


def main(out_dir: str, spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    codec_config = spec["codec_config"]
    torch.manual_seed(spec.get("seed", 0))
    model = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**codec_config)).eval()
    randomize(model, torch.Generator().manual_seed(spec.get("seed", 0)))

    st_dir = os.path.join(out_dir, "speech_tokenizer")
    os.makedirs(st_dir, exist_ok=True)
    model.save_pretrained(st_dir, safe_serialization=True)
    # save_pretrained's config.json is not the released layout: write the dict itself (research doc section 7).
    with open(os.path.join(st_dir, "config.json"), "w") as f:
        json.dump(dict(codec_config, torch_dtype="float32"), f, indent=1)
    with open(os.path.join(st_dir, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f, indent=1)

    codes = {name: torch.tensor(nested, dtype=torch.long) for name, nested in spec["codes"].items()}  # [B, 16, T]
    outputs = {}
    with torch.no_grad():
        for name in spec.get("forward", list(codes)):
            outputs[f"forward.{name}"] = model.decoder(codes[name].clamp(min=0)).contiguous()
        for name in spec.get("decode", list(codes)):
            (wavs,) = model.decode(codes[name].transpose(1, 2), return_dict=False)
            for i, wav in enumerate(wavs):
                outputs[f"decode.{name}.{i}"] = wav.contiguous()
        # The official serving path: from_pretrained(dtype=bf16). (A plain `.to(bf16)` would also round the
        # RoPE `inv_freq` buffer, which from_pretrained keeps in fp32.)
        if spec.get("bf16"):
            decoder_bf16 = Qwen3TTSTokenizerV2Model.from_pretrained(st_dir, dtype=torch.bfloat16).decoder.eval()
            for name in spec["bf16"]:
                outputs[f"forward_bf16.{name}"] = decoder_bf16(codes[name].clamp(min=0)).contiguous()
    save_file(outputs, os.path.join(out_dir, "official_decode.safetensors"))
    print(json.dumps({
        "attn_implementation": model.decoder.config._attn_implementation,
        "outputs": {k: list(v.shape) for k, v in outputs.items()},
    }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
