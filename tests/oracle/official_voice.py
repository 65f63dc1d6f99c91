"""Oracle (runs in the oracle venv): official speaker encoder + 12 Hz tokenizer at tiny shapes, their x-vectors and
ref codes.

Usage: official_voice.py OUT_DIR NAME=PATH[@SR] [...]
  PATH.npy@SR  a float32 waveform, passed to the official wrapper as (array, SR);
  PATH (other) an encoded audio file, passed as a data-URL base64 string (the wrapper decodes it with soundfile).
Writes
  OUT_DIR/weights/config.json                 {"speaker_encoder_config": ...}
  OUT_DIR/weights/model.safetensors           speaker_encoder.* (as in a Base model.safetensors)
  OUT_DIR/weights/speech_tokenizer/           config.json, model.safetensors (encoder.* + decoder.*),
                                              preprocessor_config.json
  OUT_DIR/mel_basis.npy                       librosa.filters.mel as the official mel front end builds it
  OUT_DIR/official_NAME.safetensors           x_vector [enc_dim], ref_codes [T, 16] (both from the official
                                              create_voice_clone_prompt), wav24k [n] and mels [T, 128] (intermediates)
Prints a JSON summary (code diversity) on stdout.
"""

import base64
import json
import os
import sys

import librosa
import numpy as np
import official_import  # noqa: F401  (before any qwen_tts import: stubs torchaudio)
import torch
from official_import import Qwen3TTSForConditionalGeneration, Qwen3TTSModel, Qwen3TTSTokenizer
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder, mel_spectrogram
from safetensors.torch import load_file, save_file

SPEAKER = dict(enc_dim=64, sample_rate=24000, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
               enc_se_channels=16)
CODEC_ENCODER = dict(  # research brief section 7 codec_config() encoder, after shrink()
    audio_channels=1, num_filters=8, kernel_size=7, residual_kernel_size=3, last_kernel_size=3, num_residual_layers=1,
    compress=2, upsampling_ratios=[8, 6, 5, 4], hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=2, head_dim=16, intermediate_size=64, hidden_act="gelu", norm_eps=1e-5,
    layer_scale_initial_scale=0.01, rope_theta=10000, max_position_embeddings=8000,
    # 16 instead of 250: the official Mimi (transformers 4.57, SDPA) ignores the window, so a short one makes
    # the test fail unless the engine also uses full causal attention on clips longer than the window.
    sliding_window=16,
    num_quantizers=32, num_semantic_quantizers=1, codebook_size=2048, codebook_dim=16,
    vector_quantization_hidden_dimension=16, upsample_groups=32, pad_mode="constant", use_causal_conv=True,
    sampling_rate=24000, frame_rate=12.5,
)
CODEC_DECODER = dict(
    latent_dim=64, codebook_dim=32, codebook_size=2048, decoder_dim=64, hidden_size=32, intermediate_size=64,
    hidden_act="silu", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
    rms_norm_eps=1e-5, layer_scale_initial_scale=0.01, rope_theta=10000, max_position_embeddings=8000,
    sliding_window=72, num_quantizers=16, num_semantic_quantizers=1, semantic_codebook_size=4096,
    upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], vector_quantization_hidden_dimension=32, attention_bias=False,
)
CODEC = dict(
    architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz", encoder_valid_num_quantizers=16,
    input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920, encode_downsample_rate=1920,
    encoder_config=CODEC_ENCODER, decoder_config=CODEC_DECODER,
)
# Random SEANet weights give projected latents with std ~20 (tiny shapes), so N(0, 1) codewords would all sit
# near the origin and a few extreme ones would win every frame; codewords at the latents' scale spread the codes.
CODEBOOK_STD = 16.0
# At LayerScale 0.01 (default) or even 1.0 the transformer branch is negligible next to the large SEANet residual
# stream; at 10 it moves codes: honouring the 16-frame window (as transformers 5 would) changes 11 of c24's and
# 24 of c16's 16 x ~40 codes, so the code-parity test catches it.
LAYER_SCALE = 10.0
PREPROCESSOR = dict(
    feature_extractor_type="EncodecFeatureExtractor", feature_size=1, sampling_rate=24000, padding_side="right",
    padding_value=0.0, return_attention_mask=True, chunk_length_s=None, overlap=None,
)


class FakeBaseModel:
    """The attributes of Qwen3TTSForConditionalGeneration that create_voice_clone_prompt touches."""

    tts_model_type, tokenizer_type, tts_model_size = "base", "qwen3_tts_tokenizer_12hz", "0b6"
    speaker_encoder_sample_rate = 24000
    device, dtype = torch.device("cpu"), torch.float32
    extract_speaker_embedding = Qwen3TTSForConditionalGeneration.extract_speaker_embedding  # the official method

    def __init__(self, speaker_encoder, speech_tokenizer):
        self.speaker_encoder, self.speech_tokenizer = speaker_encoder, speech_tokenizer


@torch.no_grad()
def build_weights(weights_dir: str) -> None:
    torch.manual_seed(0)
    os.makedirs(f"{weights_dir}/speech_tokenizer", exist_ok=True)
    spk = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**SPEAKER))
    save_file({f"speaker_encoder.{k}": v.contiguous() for k, v in spk.state_dict().items()},
              f"{weights_dir}/model.safetensors")
    json.dump(dict(tts_model_type="base", speaker_encoder_config=SPEAKER), open(f"{weights_dir}/config.json", "w"), indent=1)

    tok = Qwen3TTSTokenizerV2Model(Qwen3TTSTokenizerV2Config(**CODEC))
    gen = torch.Generator().manual_seed(1)
    for name, buf in tok.encoder.named_buffers():  # research brief section 7, gotcha 5: codebooks are zero by default
        if name.endswith("embed_sum"):
            buf.copy_(torch.randn(buf.shape, generator=gen) * CODEBOOK_STD)
        elif name.endswith("cluster_usage"):
            buf.copy_(torch.rand(buf.shape, generator=gen) + 0.5)
        elif name.endswith("initialized"):
            buf.fill_(1.0)
    for name, p in tok.encoder.named_parameters():
        if name.endswith("layer_scale.scale"):
            p.fill_(LAYER_SCALE)
    tok.save_pretrained(f"{weights_dir}/speech_tokenizer", safe_serialization=True)
    json.dump(CODEC, open(f"{weights_dir}/speech_tokenizer/config.json", "w"), indent=1)
    json.dump(PREPROCESSOR, open(f"{weights_dir}/speech_tokenizer/preprocessor_config.json", "w"), indent=1)


def official_mels(wav24k: np.ndarray) -> torch.Tensor:  # the call inside extract_speaker_embedding
    return mel_spectrogram(torch.from_numpy(wav24k).unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000,
                           hop_size=256, win_size=1024, fmin=0, fmax=12000).transpose(1, 2)[0]


def main(out_dir: str, specs: list[str]) -> None:
    weights = f"{out_dir}/weights"
    build_weights(weights)
    np.save(f"{out_dir}/mel_basis.npy", librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000))

    speaker_encoder = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**SPEAKER)).eval()
    sd = {k.removeprefix("speaker_encoder."): v for k, v in load_file(f"{weights}/model.safetensors").items()}
    speaker_encoder.load_state_dict(sd, strict=True)
    tokenizer = Qwen3TTSTokenizer.from_pretrained(f"{weights}/speech_tokenizer")  # official loading path
    wrapper = Qwen3TTSModel(model=FakeBaseModel(speaker_encoder, tokenizer), processor=None)

    summary = {"attn_implementation": tokenizer.model.encoder.config._attn_implementation}
    for spec in specs:
        name, path = spec.split("=", 1)
        if path.endswith(".npy") or "@" in path:
            path, sr = path.rsplit("@", 1)
            audio = (np.load(path), int(sr))
        else:
            with open(path, "rb") as f:
                audio = "data:audio/wav;base64," + base64.b64encode(f.read()).decode()
        (item,) = wrapper.create_voice_clone_prompt(ref_audio=audio, ref_text="reference transcript")
        wav, sr = wrapper._normalize_audio_inputs([audio])[0]  # the same intermediates, for diagnosis
        wav24k = wav if sr == 24000 else librosa.resample(y=wav.astype(np.float32), orig_sr=sr, target_sr=24000)
        save_file({
            "x_vector": item.ref_spk_embedding.float().contiguous(),
            "ref_codes": item.ref_code.long().contiguous(),
            "wav24k": torch.from_numpy(np.ascontiguousarray(wav24k, dtype=np.float32)),
            "mels": official_mels(wav24k).contiguous(),
        }, f"{out_dir}/official_{name}.safetensors")
        codes = item.ref_code
        summary[name] = dict(frames=codes.shape[0], unique_per_codebook=[len(set(c.tolist())) for c in codes.T])
    print(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
