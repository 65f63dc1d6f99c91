"""stages/voice: x-vectors, reference codes, mel front end and resampling against the official package; loader errors."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file

from stages.voice.audio import load_reference_audio
from stages.voice.config import ReferenceEncoderConfig, SpeakerEncoderConfig
from stages.voice.mel import log_mel_spectrogram, mel_basis
from stages.voice.reference_encoder import ReferenceAudioEncoder, randomize_codebooks_
from stages.voice.speaker_encoder import SpeakerEncoder, randomize_speaker_encoder_
from tests.oracle.venv import run_oracle

# Same tiny shapes as tests/oracle/official_voice.py (which cannot be imported here: it imports the official package).
TINY_SPEAKER = dict(enc_dim=64, sample_rate=24000, enc_channels=[32, 32, 32, 32, 96], enc_attention_channels=16,
                    enc_se_channels=16)
TINY_CODEC = dict(
    encoder_valid_num_quantizers=16, input_sample_rate=24000, encode_downsample_rate=1920,
    encoder_config=dict(
        num_filters=8, upsampling_ratios=[8, 6, 5, 4], hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, sliding_window=16, num_quantizers=32,
        codebook_size=2048, codebook_dim=16, vector_quantization_hidden_dimension=16, upsample_groups=32,
        sampling_rate=24000, frame_rate=12.5,
    ),
)


def chirp(sr: int, seconds: float, f0: float, f1: float, seed: int) -> np.ndarray:  # [n] float32
    t = np.arange(int(sr * seconds)) / sr
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    return (0.5 * np.sin(2 * np.pi * (f0 * t + 0.5 * (f1 - f0) / seconds * t * t)) + 0.05 * noise).astype(np.float32)


def wav_bytes(audio: np.ndarray, sr: int, subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, sr, format="WAV", subtype=subtype)
    return buf.getvalue()


# name -> our input; the oracle gets the same audio (24 kHz: 79,317 samples, not a multiple of 1920 frames).
CASES = {
    "c24": (chirp(24000, 3.3049, 100, 4000, 1), 24000),
    "c16": (chirp(16000, 2.7, 200, 6000, 2), 16000),  # resampled 16 -> 24 kHz
    "c44": wav_bytes(np.stack([chirp(44100, 2.2, 150, 9000, 3), chirp(44100, 2.2, 300, 3000, 4)], 1), 44100),  # stereo
}


@pytest.fixture(scope="session")
def official(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("voice_oracle")
    specs = []
    for name, src in CASES.items():
        if isinstance(src, bytes):
            (d / f"{name}.wav").write_bytes(src)
            specs.append(f"{name}={d / name}.wav")
        else:
            np.save(d / f"{name}.npy", src[0])
            specs.append(f"{name}={d / name}.npy@{src[1]}")
    summary = json.loads(run_oracle("official_voice.py", str(d), *specs).strip().splitlines()[-1])
    assert summary["attn_implementation"] == "sdpa"
    return d


@pytest.fixture(scope="session")
def speaker_encoder(official) -> SpeakerEncoder:
    cfg = json.loads((official / "weights/config.json").read_text())["speaker_encoder_config"]
    enc = SpeakerEncoder(SpeakerEncoderConfig.from_dict(cfg)).eval()
    tensors = load_file(official / "weights/model.safetensors")
    enc.load_state_dict({k.removeprefix("speaker_encoder."): v for k, v in tensors.items()}, strict=True)
    return enc


@pytest.fixture(scope="session")
def reference_encoder(official) -> ReferenceAudioEncoder:
    cfg = json.loads((official / "weights/speech_tokenizer/config.json").read_text())
    enc = ReferenceAudioEncoder(ReferenceEncoderConfig.from_dict(cfg)).eval()
    tensors = load_file(official / "weights/speech_tokenizer/model.safetensors")
    enc.load_state_dict({k.removeprefix("encoder."): v for k, v in tensors.items() if k.startswith("encoder.")}, strict=True)
    return enc


def official_outputs(official: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(official / f"official_{name}.safetensors")


# ---- parity with the official package -------------------------------------------------------------------------


@pytest.mark.oracle
def test_mel_filter_bank_matches_librosa(official):
    ours, theirs = mel_basis(), np.load(official / "mel_basis.npy")
    assert ours.shape == theirs.shape == (128, 513) and ours.dtype == theirs.dtype == np.float32
    assert np.abs(ours - theirs).max() < 1e-6  # measured 3.7e-9 (a last-bit rounding difference in a few weights)


@pytest.mark.oracle
@pytest.mark.parametrize("name", CASES)
def test_resampling_and_decoding_match_librosa(official, name):
    ours = load_reference_audio(CASES[name])
    theirs = official_outputs(official, name)["wav24k"].numpy()
    assert ours.dtype == np.float32 and np.array_equal(ours, theirs)  # bit-identical


@pytest.mark.oracle
@pytest.mark.parametrize("name", CASES)
def test_log_mel_matches_official(official, name):
    o = official_outputs(official, name)
    mels = log_mel_spectrogram(o["wav24k"])[0]
    assert mels.shape == o["mels"].shape
    assert (mels - o["mels"]).abs().max().item() < 1e-5  # measured <= 9.5e-7


@pytest.mark.oracle
@pytest.mark.parametrize("name", CASES)
def test_x_vector_matches_official(official, speaker_encoder, name):
    theirs = official_outputs(official, name)["x_vector"]
    ours = speaker_encoder.embed(torch.from_numpy(load_reference_audio(CASES[name])))
    assert ours.shape == theirs.shape == (64,)
    assert (ours - theirs).abs().max().item() < 1e-5  # measured <= 1.4e-7


@pytest.mark.oracle
@pytest.mark.parametrize("name", CASES)
def test_reference_codes_match_official(official, reference_encoder, name):
    theirs = official_outputs(official, name)["ref_codes"]
    wav = load_reference_audio(CASES[name])
    ours = reference_encoder.encode(torch.from_numpy(wav))
    assert ours.dtype == torch.long and ours.shape == theirs.shape == (math.ceil(len(wav) / 1920), 16)
    assert torch.equal(ours, theirs)  # every codebook, every frame
    assert min(len(c.unique()) for c in ours.T) > 1  # codes depend on the audio


@pytest.mark.oracle
def test_state_dict_names_match_official_checkpoint(official, speaker_encoder, reference_encoder):
    spk = {k.removeprefix("speaker_encoder.") for k in load_file(official / "weights/model.safetensors")}
    tok = set(load_file(official / "weights/speech_tokenizer/model.safetensors"))
    assert set(speaker_encoder.state_dict()) == spk
    assert set(reference_encoder.state_dict()) == {k.removeprefix("encoder.") for k in tok if k.startswith("encoder.")}
    assert not any(k.startswith(("decoder", "upsample")) for k in reference_encoder.state_dict())


# ---- modules without the oracle --------------------------------------------------------------------------------


def test_config_defaults_match_official_classes():
    cfg = SpeakerEncoderConfig.from_dict({"enc_dim": 2048, "sample_rate": 24000})  # what releases write
    assert cfg == SpeakerEncoderConfig(enc_dim=2048)
    assert cfg.enc_channels == (512, 512, 512, 512, 1536) and cfg.enc_se_channels == 128
    # Parameter counts of the official Qwen3TTSSpeakerEncoder (research brief section 1.5), measured there.
    for enc_dim, n in ((1024, 8_854_336), (2048, 12_001_088)):
        assert sum(p.numel() for p in SpeakerEncoder(SpeakerEncoderConfig(enc_dim=enc_dim)).parameters()) == n
    with pytest.raises(ValueError, match="same length"):
        SpeakerEncoderConfig(enc_kernel_sizes=(5, 3, 3, 1))
    ref = ReferenceEncoderConfig.from_dict(TINY_CODEC)
    mimi = ref.mimi_config()
    assert ref.num_quantizers == 16 and mimi.sliding_window > 10**6 and mimi._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="encoder_valid_num_quantizers"):
        ReferenceEncoderConfig.from_dict(dict(TINY_CODEC, encoder_valid_num_quantizers=33))


def test_speaker_encoder_batch_equals_rows():
    torch.manual_seed(0)
    enc = SpeakerEncoder(SpeakerEncoderConfig.from_dict(TINY_SPEAKER)).eval()
    mels = log_mel_spectrogram(torch.from_numpy(np.stack([chirp(24000, 1.0, 100, 3000, s) for s in (5, 6)])))
    with torch.no_grad():
        batch = enc(mels)
        rows = torch.cat([enc(mels[i : i + 1]) for i in range(2)])
    assert batch.shape == (2, 64) and torch.allclose(batch, rows, atol=1e-6)


def test_randomize_helpers_are_deterministic_and_invalidate_codebook_cache():
    spk = [SpeakerEncoder(SpeakerEncoderConfig.from_dict(TINY_SPEAKER)) for _ in range(2)]
    for enc in spk:
        randomize_speaker_encoder_(enc, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(spk[0].state_dict().values(), spk[1].state_dict().values(), strict=True))

    cfg = ReferenceEncoderConfig.from_dict(TINY_CODEC)
    a, b = ReferenceAudioEncoder(cfg).eval(), ReferenceAudioEncoder(cfg).eval()
    wav = torch.from_numpy(chirp(24000, 1.0, 100, 3000, 7))
    assert a.encode(wav).unique().tolist() == [0]  # default init: all codewords zero
    randomize_codebooks_(a, torch.Generator().manual_seed(1))  # must drop Mimi's cached codebooks
    codes_a = a.encode(wav)
    assert len(codes_a.unique()) > 1
    randomize_codebooks_(b, torch.Generator().manual_seed(2))
    codes_b = b.encode(wav)
    a.load_state_dict(b.state_dict())  # the post-load hook must drop the cache too
    assert torch.equal(a.encode(wav), codes_b) and not torch.equal(codes_a, codes_b)


# ---- audio loading ---------------------------------------------------------------------------------------------


def test_load_reference_audio_formats_and_lengths():
    mono = chirp(16000, 1.0, 100, 3000, 8)
    out = load_reference_audio((mono, 16000))
    assert out.dtype == np.float32 and out.shape == (24000,)
    out = load_reference_audio((chirp(22050, 1.0, 100, 3000, 8)[:22049], 22050))  # ceil(22049 * 24000 / 22050)
    assert out.shape == (23999,)
    stereo = np.stack([mono, -mono], 1)
    assert np.abs(load_reference_audio((stereo, 24000))).max() == 0.0  # (samples, channels) averaged
    for fmt in ("WAV", "FLAC", "OGG"):
        buf = io.BytesIO()
        sf.write(buf, stereo, 16000, format=fmt)
        assert load_reference_audio(buf.getvalue()).shape == (24000,)


@pytest.mark.parametrize("source, kwargs, message", [
    (b"definitely not audio", {}, "could not decode"),
    (b"", {}, "empty"),
    ((np.zeros(0, np.float32), 24000), {}, "empty"),
    ((np.zeros(3 * 24000, np.float32), 24000), {"max_seconds": 2}, "3.0 s long; the limit is 2 s"),
    ((np.full(24000, np.nan, np.float32), 24000), {}, "NaN"),
    ((np.zeros(100, np.float32), 24000), {}, "at least"),
    ((np.zeros(24000, np.int16), 24000), {}, "floats"),
    ((np.zeros((2, 2, 24000), np.float32), 24000), {}, "1-D"),
    ((np.zeros(24000, np.float32), 0), {}, "sample rate"),
    ((np.zeros(24000, np.float32), 24000.0), {}, "sample rate"),
    ("a/path.wav", {}, "encoded bytes or"),
])
def test_load_reference_audio_errors_are_clear(source, kwargs, message):
    with pytest.raises(ValueError, match=message):
        load_reference_audio(source, **kwargs)
