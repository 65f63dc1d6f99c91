"""The oracle: the official `qwen-tts==0.1.1` package in an isolated, cached virtualenv.

The official package pins transformers 4.57.3, which conflicts with ours, so it lives in its own
virtualenv. The venv is created on first use (a few minutes, needs PyPI) and cached under
`$QWEN3_TTS_ORACLE_VENV` (default `~/.cache/qwen3-tts-serve/oracle-<hash>`), keyed by the pins below.
Scripts run inside it with `run_oracle(script, *args)`; they exchange tensors through files.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import torch

from tests.cached_venv import cached_venv

ORACLE_PINS = (
    "transformers==4.57.3",
    "accelerate==1.12.0",
    "librosa",
    "soundfile",
    "einops",
    "onnxruntime",
    "sox",
)
ORACLE_PACKAGE = "qwen-tts==0.1.1"  # installed --no-deps: its torchaudio/gradio deps are not needed offline
HERE = Path(__file__).resolve().parent


def _torch_requirement() -> str:
    # Same torch as the main env so that both sides run identical kernels; a local CPU wheel
    # is preferred when present (a plain `torch` from PyPI pulls GBs of CUDA).
    version = torch.__version__.split("+")[0]
    for wheel_dir in ("/opt/wheels",):
        for wheel in sorted(Path(wheel_dir).glob(f"torch-{version}*.whl")) if Path(wheel_dir).is_dir() else []:
            return str(wheel)
    return f"torch=={version}"


def oracle_venv_dir() -> Path:
    key = hashlib.sha256("\n".join((*ORACLE_PINS, ORACLE_PACKAGE, torch.__version__)).encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "qwen3-tts-serve" / f"oracle-{key}"
    return Path(os.environ.get("QWEN3_TTS_ORACLE_VENV", default))


def oracle_python() -> Path:
    """Path to the oracle venv's python, creating the venv once (a few minutes)."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, _torch_requirement(), *ORACLE_PINS], check=True)
        subprocess.run([*pip, "--no-deps", ORACLE_PACKAGE], check=True)

    return cached_venv(oracle_venv_dir(), "oracle", install)


def run_oracle(script: str, *args: str, timeout: float = 1200) -> str:
    """Run `tests/oracle/<script>` inside the oracle venv; returns its stdout, raises with its stderr."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(HERE))
    proc = subprocess.run(
        [str(oracle_python()), str(HERE / script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"oracle script {script} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc.stdout
