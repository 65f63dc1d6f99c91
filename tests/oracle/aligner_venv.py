"""The aligner oracle: the official `qwen-asr==0.0.6` package in its own isolated, cached virtualenv.

qwen-asr pins transformers 4.57.6 (the TTS oracle pins 4.57.3, ours is newer), so it cannot share either
environment. Created on first use (a few minutes, needs PyPI), cached under `$QWEN3_ASR_ORACLE_VENV`
(default `~/.cache/qwen3-tts-serve/asr-oracle-<hash>`), keyed by the pins below.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import torch

from tests.cached_venv import cached_venv
from tests.oracle.venv import _torch_requirement

# The official requirements the aligner path imports (nagisa and soynlp segment Japanese and Korean);
# gradio, flask and qwen-omni-utils serve only the package's demos and are left out.
ASR_ORACLE_PINS = (
    "transformers==4.57.6",
    "accelerate==1.12.0",
    "nagisa==0.2.11",
    "soynlp==0.0.493",
    "librosa",
    "soundfile",
)
ASR_ORACLE_PACKAGE = "qwen-asr==0.0.6"  # --no-deps: its demo dependencies are not needed
HERE = Path(__file__).resolve().parent


def asr_oracle_venv_dir() -> Path:
    key = hashlib.sha256("\n".join((*ASR_ORACLE_PINS, ASR_ORACLE_PACKAGE, torch.__version__)).encode()).hexdigest()
    default = Path.home() / ".cache" / "qwen3-tts-serve" / f"asr-oracle-{key[:12]}"
    return Path(os.environ.get("QWEN3_ASR_ORACLE_VENV", default))


def asr_oracle_python() -> Path:
    """Path to the aligner oracle venv's python, creating the venv once (a few minutes)."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, _torch_requirement(), *ASR_ORACLE_PINS], check=True)
        subprocess.run([*pip, "--no-deps", ASR_ORACLE_PACKAGE], check=True)

    return cached_venv(asr_oracle_venv_dir(), "asr-oracle", install)


def run_asr_oracle(script: str, *args: str, timeout: float = 1200) -> str:
    """Run `tests/oracle/<script>` inside the aligner oracle venv; returns its stdout, raises with its stderr."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(HERE))
    proc = subprocess.run(
        [str(asr_oracle_python()), str(HERE / script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"oracle script {script} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc.stdout
