"""Shared fixtures: tiny random checkpoints written by our own writer, once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# one torch (OpenMP) thread in this process, as in every replica (the shipped configs' env_vars) and every process the
# tests start: set before numpy or torch load OpenMP. Tiny models gain nothing from a second thread, and on a 2-core
# machine where anything else runs, a parallel region waits for the thread that is not scheduled (tests in this
# process took up to twice as long)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the serve home of this session (and of the Ray replicas it starts, which inherit the environment): no batch store,
# voice or embedded checkpoint left by an earlier or interrupted run is resumed or read (tests/procs.serve_run gives
# each `serve run` a fresh one of its own)
if "QWEN3_TTS_SERVE_HOME" not in os.environ:
    os.environ["QWEN3_TTS_SERVE_HOME"] = tempfile.mkdtemp(prefix="qwen3-tts-tests-home-")
    atexit.register(shutil.rmtree, os.environ["QWEN3_TTS_SERVE_HOME"], True)


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_checkpoints")


def _write(root: Path, name: str, size: str, kind: str, dtype: str) -> Path:
    from stages.random_checkpoint import write_random_checkpoint

    out = root / name
    if not (out / "config.json").exists():
        write_random_checkpoint(out, size, kind, tiny=True, dtype=dtype, seed=1234, log=lambda _m: None)
    return out


@pytest.fixture(scope="session")
def tiny_custom_voice(tiny_ckpt_dir) -> Path:
    """1.7B-style CustomVoice (accepts instructions), tiny shapes, fp32 for exact parity."""
    return _write(tiny_ckpt_dir, "cv17", "1.7b", "custom_voice", "float32")


@pytest.fixture(scope="session")
def tiny_custom_voice_06(tiny_ckpt_dir) -> Path:
    return _write(tiny_ckpt_dir, "cv06", "0.6b", "custom_voice", "float32")


@pytest.fixture(scope="session")
def tiny_voice_design(tiny_ckpt_dir) -> Path:
    return _write(tiny_ckpt_dir, "vd17", "1.7b", "voice_design", "float32")


@pytest.fixture(scope="session")
def tiny_base(tiny_ckpt_dir) -> Path:
    return _write(tiny_ckpt_dir, "base17", "1.7b", "base", "float32")


def reference_clip(seconds: float = 2.5, sr: int = 24000, seed: int = 0) -> np.ndarray:
    """A deterministic test clip: a chirp with harmonics and a little noise, float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    f = 120 + 200 * t / seconds
    wav = 0.4 * np.sin(2 * np.pi * f * t) + 0.2 * np.sin(4 * np.pi * f * t) + 0.02 * rng.standard_normal(t.size)
    return (wav * np.hanning(t.size) ** 0.1).astype(np.float32)


def tiny_model_info(name: str, path: Path, aliases=()):
    """The `ModelInfo` a Talker would send the ingress for the tiny checkpoint at `path` (512 positions, 300 frames)."""
    from deployments.messages import ModelInfo
    from stages.config import GenerationDefaults, ModelConfig
    from stages.prompts import TextTokenizer

    return ModelInfo(name=name, aliases=tuple(aliases), config=ModelConfig.from_file(path / "config.json"),
                     generation=GenerationDefaults.from_file(path / "generation_config.json"),
                     tokenizer=TextTokenizer(path), max_seq_len=512, max_text_rows=1024, fingerprint=name,
                     default_max_new_tokens=300)
