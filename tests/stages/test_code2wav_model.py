"""Code2WavDecoder vs the official codec decoder (tiny random checkpoint), causality, batched chunk decode."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.code2wav.config import DecoderConfig
from stages.code2wav.model import Code2WavDecoder, randomize_codebooks_
from tests.code2wav_reference import decode_chunks

SPF = 1920
TOL = 1e-5
# name -> (batch, frames). 100 > sliding window 72 (official switches from is_causal to an explicit mask);
# 330 > 300 makes the official `decode` use two chunks (300 frames, then 25 context + 30).
SHAPES = {"t1": (2, 1), "t7": (2, 7), "t40": (2, 40), "t100": (2, 100), "t330": (1, 330)}


def tiny_codec_config() -> dict:
    """Research doc section 7 `codec_config()` after `shrink()`: tiny widths, real 16 x 2048 codes, 1920 hop."""
    enc = dict(
        audio_channels=1, num_filters=8, kernel_size=7, residual_kernel_size=3, last_kernel_size=3, num_residual_layers=1,
        compress=2, upsampling_ratios=[8, 6, 5, 4], hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, hidden_act="gelu", norm_eps=1e-5,
        layer_scale_initial_scale=0.01, rope_theta=10000, max_position_embeddings=8000, sliding_window=250,
        num_quantizers=32, num_semantic_quantizers=1, codebook_size=2048, codebook_dim=16,
        vector_quantization_hidden_dimension=16, upsample_groups=32, pad_mode="constant", use_causal_conv=True,
        sampling_rate=24000, frame_rate=12.5,
    )
    dec = dict(
        latent_dim=64, codebook_dim=32, codebook_size=2048, decoder_dim=64, hidden_size=32, intermediate_size=64,
        hidden_act="silu", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, layer_scale_initial_scale=0.01, rope_theta=10000, max_position_embeddings=8000,
        sliding_window=72, num_quantizers=16, num_semantic_quantizers=1, semantic_codebook_size=4096,
        upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], vector_quantization_hidden_dimension=32,
        attention_bias=False,
    )
    return dict(
        architectures=["Qwen3TTSTokenizerV2Model"], model_type="qwen3_tts_tokenizer_12hz", encoder_valid_num_quantizers=16,
        input_sample_rate=24000, output_sample_rate=24000, decode_upsample_rate=1920, encode_downsample_rate=1920,
        encoder_config=enc, decoder_config=dec,
    )


def random_codes(batch: int, frames: int, seed: int) -> torch.Tensor:  # [B, 16, T]
    return torch.randint(0, 2048, (batch, 16, frames), generator=torch.Generator().manual_seed(seed))


def load_decoder(speech_tokenizer_dir: Path) -> Code2WavDecoder:
    """Stand-in for stages/checkpoint/: strict load of the `decoder.` tensors, prefix stripped."""
    cfg = DecoderConfig.from_dict(json.loads((speech_tokenizer_dir / "config.json").read_text())["decoder_config"])
    tensors = load_file(speech_tokenizer_dir / "model.safetensors")
    state = {k.removeprefix("decoder."): v for k, v in tensors.items() if k.startswith("decoder.")}
    decoder = Code2WavDecoder(cfg)
    decoder.load_state_dict(state, strict=True)
    return decoder.eval()


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.fixture(scope="session")
def official(tmp_path_factory) -> dict:
    """Build the official tiny codec once, decode SHAPES' codes plus a -1-padded batch with it."""
    from tests.oracle.venv import run_oracle

    out = tmp_path_factory.mktemp("official_codec")
    codes = {name: random_codes(b, t, seed=i) for i, (name, (b, t)) in enumerate(SHAPES.items())}
    padded = random_codes(2, 30, seed=99)
    padded[1, :, 18:] = -1  # item 1 has 18 real frames (official batch convention)
    codes["padded"] = padded
    spec = {
        "codec_config": tiny_codec_config(), "seed": 0, "codes": {k: v.tolist() for k, v in codes.items()},
        "forward": ["t1", "t7", "t40", "t100"], "decode": ["t7", "t330", "padded"], "bf16": ["t7"],
    }
    (out / "spec.json").write_text(json.dumps(spec))
    summary = json.loads(run_oracle("official_codec.py", str(out), str(out / "spec.json")).strip().splitlines()[-1])
    return dict(
        dir=out / "speech_tokenizer", codes=codes, summary=summary,
        wav=load_file(out / "official_decode.safetensors"),
    )


@pytest.fixture(scope="session")
def decoder(official) -> Code2WavDecoder:
    return load_decoder(official["dir"])


@pytest.fixture(scope="module")
def random_decoder() -> Code2WavDecoder:
    """Oracle-free tiny decoder for the structural tests."""
    torch.manual_seed(0)
    decoder = Code2WavDecoder(DecoderConfig.from_dict(tiny_codec_config()["decoder_config"])).eval()
    randomize_codebooks_(decoder, torch.Generator().manual_seed(0))
    return decoder


# ---- (a) parity with the official decoder -------------------------------------------------------------


@pytest.mark.oracle
@pytest.mark.parametrize("name", [n for n in SHAPES if n != "t330"])
def test_forward_matches_official(official, decoder, name):
    with torch.no_grad():
        ours = decoder(official["codes"][name])
    ref = official["wav"][f"forward.{name}"]
    diff = max_abs(ours, ref)
    print(f"\n{name}: shape {tuple(ours.shape)} max|ours - official forward| = {diff:.3e}")
    assert ours.shape == (SHAPES[name][0], 1, SHAPES[name][1] * SPF)
    assert ref.abs().max() > 1e-2  # the checkpoint is not degenerate
    assert diff <= TOL
    # The official `.decode` API (a single chunk for <= 300 frames) agrees with its own forward.
    for i in range(SHAPES[name][0]):
        if f"decode.{name}.{i}" in official["wav"]:
            assert max_abs(ours[i, 0], official["wav"][f"decode.{name}.{i}"]) <= TOL


@pytest.mark.oracle
def test_bf16_forward_matches_official_bf16(official, decoder):
    """The serving dtype: same op order as the official code, so bf16 rounding matches too."""
    with torch.no_grad():
        ours = copy.deepcopy(decoder).to(torch.bfloat16)(official["codes"]["t7"])
    ref = official["wav"]["forward_bf16.t7"]
    diff = max_abs(ours.float(), ref.float())
    print(f"\nt7 bf16: max|ours - official| = {diff:.3e}")
    assert diff <= 1e-2  # measured 0 on CPU; bf16 kernels on other devices may round differently


@pytest.mark.oracle
def test_official_chunked_decode_via_decode_chunks(official, decoder):
    """Official `decode` of 330 frames = chunk [0, 300) + chunk [275, 330) with 25 frames of context."""
    codes = official["codes"]["t330"][0].T  # [330, 16]
    with torch.no_grad():
        first, second = decode_chunks(decoder, [(codes[:300], 0), (codes[275:], 25)])
    ours = torch.cat([first, second])
    diff = max_abs(ours, official["wav"]["decode.t330.0"])
    print(f"\nt330 chunked: max|ours - official decode| = {diff:.3e}")
    assert diff <= TOL


@pytest.mark.oracle
def test_padded_batch_matches_official_decode(official, decoder):
    """Official batch convention (-1 right padding, cut to n_frames * 1920) = our right-padded chunks."""
    codes = official["codes"]["padded"]
    lengths = (codes[:, 0] > -1).sum(1).tolist()
    with torch.no_grad():
        wavs = decode_chunks(decoder, [(codes[i, :, :n].T, 0) for i, n in enumerate(lengths)])
    for i, wav in enumerate(wavs):
        diff = max_abs(wav, official["wav"][f"decode.padded.{i}"])
        print(f"\npadded item {i} ({lengths[i]} frames): max diff {diff:.3e}")
        assert diff <= TOL


# ---- (b) causality --------------------------------------------------------------------------------------


def test_prefix_decode_is_prefix_of_full_decode(random_decoder):
    codes = random_codes(1, 80, seed=1)
    with torch.no_grad():
        full = random_decoder(codes)
        for prefix in (1, 17, 73):
            diff = max_abs(random_decoder(codes[..., :prefix]), full[..., : prefix * SPF])
            print(f"\nprefix {prefix}: max diff vs full decode {diff:.3e}")
            assert diff <= TOL


def test_future_codes_do_not_change_past_samples(random_decoder):
    codes = random_codes(1, 30, seed=2)
    changed = codes.clone()
    changed[..., 12:] = random_codes(1, 18, seed=3)
    with torch.no_grad():
        a, b = random_decoder(codes), random_decoder(changed)
    assert torch.equal(a[..., : 12 * SPF], b[..., : 12 * SPF])  # same shapes, same kernels: bitwise
    assert max_abs(a[..., 12 * SPF :], b[..., 12 * SPF :]) > 1e-3


# ---- (c) the codes matter -------------------------------------------------------------------------------


@pytest.mark.parametrize("codebook", [0, 1, 15])
def test_output_depends_on_every_codebook_group(random_decoder, codebook):
    codes = random_codes(1, 8, seed=4)
    changed = codes.clone()
    changed[:, codebook] = (changed[:, codebook] + 1) % 2048
    with torch.no_grad():
        diff = max_abs(random_decoder(codes), random_decoder(changed))
    assert diff > 1e-3, f"changing codebook {codebook} barely changed the audio ({diff:.2e})"


# ---- batched chunk decode ------------------------------------------------------------------------------


def test_decode_chunks_batched_equals_one_by_one(random_decoder):
    streams = [random_codes(1, t, seed=10 + t)[0].T for t in (5, 23, 41)]  # [T, 16] each
    chunks = [(streams[0], 0), (streams[1], 20), (streams[2], 25)]
    with torch.no_grad():
        batched = decode_chunks(random_decoder, chunks)
        single = [decode_chunks(random_decoder, [c])[0] for c in chunks]
    for (codes, ctx), b, s in zip(chunks, batched, single, strict=True):
        assert b.shape == ((codes.shape[0] - ctx) * SPF,)
        diff = max_abs(b, s)
        print(f"\nchunk len {codes.shape[0]} ctx {ctx}: batched vs alone {diff:.3e}")
        assert diff <= TOL


def test_decode_chunks_whole_utterance_and_first_chunk(random_decoder):
    codes = random_codes(1, 24, seed=20)  # [1, 16, 24]
    with torch.no_grad():
        full = random_decoder(codes)[0, 0]
        whole, first = decode_chunks(random_decoder, [(codes[0].T, 0), (codes[0, :, :9].T, 0)])
    assert max_abs(whole, full) <= TOL
    assert max_abs(first, full[: 9 * SPF]) <= TOL


def test_config_defaults_are_the_released_codec():
    cfg = DecoderConfig.from_dict({"unknown_key": 1, "upsample_rates": [8, 5, 4, 3]})
    assert cfg == DecoderConfig()
    assert cfg.samples_per_frame == SPF
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Code2WavDecoder(cfg).parameters())
    assert n_params == 114_323_137  # = the official decoder at the released shapes (meta-device count)
