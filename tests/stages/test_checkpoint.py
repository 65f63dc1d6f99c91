"""Checkpoint resolution, strict loading errors, configs of every released variant, the writer's layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stages.checkpoint import CheckpointError, resolve_checkpoint
from stages.config import ModelConfig
from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import KINDS, SIZES, codec_config, main_config


@pytest.fixture()
def ckpt_copy(tiny_custom_voice, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_custom_voice, dst)
    return dst


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_loads_and_fills_every_module(tiny_base):
    model = Qwen3TTS.load(tiny_base, dtype="float32")
    assert model.talker is not None and model.decoder is not None
    assert model.speaker_encoder is not None and model.reference_encoder is not None
    assert not any(p.is_meta for p in model.talker.parameters())
    assert model.talker.codec_head.weight.dtype == torch.float32
    bf16 = Qwen3TTS.load(tiny_base, dtype="bfloat16", voice=False, decoder=False)
    assert bf16.talker.codec_head.weight.dtype == torch.bfloat16


def test_missing_tensor_is_named(ckpt_copy):
    name = "talker.model.layers.1.mlp.up_proj.weight"
    _rewrite(ckpt_copy / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        Qwen3TTS.load(ckpt_copy, dtype="float32", decoder=False)


def test_wrong_shape_is_named(ckpt_copy):
    name = "talker.codec_head.weight"

    def edit(t):
        t[name] = torch.zeros(t[name].shape[0] + 1, t[name].shape[1])
    _rewrite(ckpt_copy / "model.safetensors", edit)
    with pytest.raises(CheckpointError, match=r"talker\.codec_head\.weight has shape \(3073, 64\), expected \(3072, 64\)"):
        Qwen3TTS.load(ckpt_copy, dtype="float32", decoder=False)


def test_unexpected_tensor_is_named(ckpt_copy):
    _rewrite(ckpt_copy / "speech_tokenizer" / "model.safetensors",
             lambda t: t.__setitem__("decoder.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) decoder\.extra\.weight"):
        Qwen3TTS.load(ckpt_copy, dtype="float32", talker=False)


def test_corrupted_file_is_reported(ckpt_copy):
    path = ckpt_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Qwen3TTS.load(ckpt_copy, dtype="float32", decoder=False)


def test_missing_file_is_named(ckpt_copy):
    (ckpt_copy / "speech_tokenizer" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="speech_tokenizer/model.safetensors"):
        resolve_checkpoint(ckpt_copy)


def test_hf_cache_model_id_resolves_to_snapshot(tiny_custom_voice, tmp_path, monkeypatch):
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub"
    repo = cache / "models--Qwen--Qwen3-TTS-12Hz-1.7B-CustomVoice"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_custom_voice, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = resolve_checkpoint("Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice")
    assert resolved == repo / "snapshots" / commit
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        resolve_checkpoint("Qwen/Not-There")
    with pytest.raises(CheckpointError, match="neither a directory nor"):
        resolve_checkpoint("./no/such/dir")


@pytest.mark.parametrize("size,kind", [("0.6b", "custom_voice"), ("0.6b", "base"), ("1.7b", "custom_voice"),
                                       ("1.7b", "base"), ("1.7b", "voice_design")])
def test_released_variant_configs_parse(size, kind):
    cfg = ModelConfig.from_dict(json.loads(json.dumps(main_config(size, kind, tiny=False))))
    hidden = 2048 if size == "1.7b" else 1024
    assert cfg.talker.hidden_size == hidden
    assert cfg.talker.transformer.num_hidden_layers == 28
    assert cfg.talker.code_predictor.transformer.num_hidden_layers == 5
    assert cfg.talker.codec.eos == 2150 and cfg.text_ids.tts_pad == 151671
    assert cfg.model_size == SIZES[size] and cfg.model_kind == kind
    assert ("sichuan_dialect" in cfg.talker.languages) == (kind == "custom_voice")
    assert cfg.accepts_instruction == (kind == "voice_design" or (kind == "custom_voice" and size == "1.7b"))
    assert (cfg.speaker_encoder is not None) == (kind == "base")
    assert "sichuan_dialect" not in cfg.public_languages and "auto" in cfg.public_languages
    assert codec_config(tiny=False)["decoder_config"]["sliding_window"] == 72


def test_no_06b_voice_design_and_bad_kind():
    with pytest.raises(ValueError, match="no 0.6B VoiceDesign"):
        main_config("0.6b", "voice_design", tiny=False)
    with pytest.raises(ValueError, match="kind must be one of"):
        main_config("0.6b", "podcast", tiny=False)
    assert set(KINDS) == {"custom_voice", "base", "voice_design"}


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="tts_model_type"):
        ModelConfig.from_dict({"model_type": "qwen3_tts", "tts_model_type": "nope", "talker_config": {}})
    with pytest.raises(ValueError, match="12 Hz"):
        ModelConfig.from_dict({"tts_model_type": "base", "tokenizer_type": "qwen3_tts_tokenizer_25hz",
                               "talker_config": {}})


WEIGHT_FILES = ("model.safetensors", "speech_tokenizer/model.safetensors")


@pytest.mark.parametrize("size,kind", [("0.6b", "base"), ("1.7b", "custom_voice")])
def test_same_seed_writes_byte_identical_weights(size, kind, tmp_path):
    from stages.random_checkpoint import write_random_checkpoint

    def write(name: str, seed: int) -> Path:
        return write_random_checkpoint(tmp_path / name, size, kind, tiny=True, dtype="float32", seed=seed,
                                       log=lambda _m: None)

    torch.manual_seed(1)
    first = write("a", seed=7)
    torch.manual_seed(2)  # a different global random state must not matter...
    torch.rand(1000)
    state = torch.random.get_rng_state()
    second = write("b", seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)  # ...and the caller's state is left as it was
    other = write("c", seed=8)
    for name in WEIGHT_FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
        assert (first / name).read_bytes() != (other / name).read_bytes(), name


def test_tiny_checkpoints_cover_both_code_predictor_projections(tiny_custom_voice_06, tiny_custom_voice):
    small = Qwen3TTS.load(tiny_custom_voice_06, dtype="float32", decoder=False)
    large = Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)
    # 0.6B: talker as wide as the code predictor (as released); 1.7B: a Linear projection between them
    assert small.config.talker.hidden_size == small.config.talker.code_predictor.transformer.hidden_size
    assert isinstance(small.talker.code_predictor.small_to_mtp_projection, torch.nn.Identity)
    assert isinstance(large.talker.code_predictor.small_to_mtp_projection, torch.nn.Linear)


@pytest.mark.parametrize("kind", ["base", "custom_voice"])
def test_cli_writes_byte_identical_files_in_fresh_processes(kind, tmp_path):
    """`python -m stages.checkpoint random DIR --seed 7` twice: every file byte-identical. Fresh processes with
    different thread counts (a CI box and a workstation differ): the codec's codebook scale, measured on a probe
    signal, once carried the thread count's float sums into the weights."""
    import os
    import subprocess
    import sys

    def write(name: str, threads: int) -> Path:
        out = tmp_path / name
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        subprocess.run([sys.executable, "-m", "stages.checkpoint", "random", str(out), "--tiny", "--kind", kind,
                        "--seed", "7"], check=True, env=env, capture_output=True, timeout=600)
        return out

    first, second = write("a", threads=1), write("b", threads=2)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert {str(f) for f in files} >= {*WEIGHT_FILES, "config.json", "vocab.json"}
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    for name in files:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
