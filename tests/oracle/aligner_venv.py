"""The aligner oracle: the official `qwen-asr==0.0.6` package in its own isolated, cached virtualenv.

qwen-asr pins transformers 4.57.6 (the TTS oracle pins 4.57.3, ours is newer), so it cannot share either
environment. Created on first use (a few minutes, needs PyPI), cached under `$QWEN3_ASR_ORACLE_VENV`
(default `~/.cache/qwen3-tts-serve/asr-oracle-<hash>`), keyed by the pins below.
"""

from __future__ import annotations

from pathlib import Path

from tests.oracle.venv import run_in, venv_dir, venv_python

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
    return venv_dir("QWEN3_ASR_ORACLE_VENV", "asr-oracle", ASR_ORACLE_PINS, ASR_ORACLE_PACKAGE)


def asr_oracle_python() -> Path:
    """Path to the aligner oracle venv's python, creating the venv once (a few minutes)."""
    return venv_python(asr_oracle_venv_dir(), "asr-oracle", ASR_ORACLE_PINS, ASR_ORACLE_PACKAGE)


def run_asr_oracle(script: str, *args: str, timeout: float = 1200) -> str:
    """Run `tests/oracle/<script>` inside the aligner oracle venv; returns its stdout, raises with its stderr."""
    return run_in(asr_oracle_python(), script, *args, timeout=timeout,
                  preload=("torch", "qwen_asr", "qwen_asr.core.transformers_backend.modeling_qwen3_asr"))
