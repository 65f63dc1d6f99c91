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

from tests import forkserver
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


def venv_dir(env_var: str, prefix: str, pins: tuple[str, ...], package: str) -> Path:
    """`$env_var`, else `~/.cache/qwen3-tts-serve/<prefix>-<hash of the pins, the package and our torch>`."""
    key = hashlib.sha256("\n".join((*pins, package, torch.__version__)).encode()).hexdigest()[:12]
    return Path(os.environ.get(env_var, Path.home() / ".cache" / "qwen3-tts-serve" / f"{prefix}-{key}"))


def venv_python(venv: Path, label: str, pins: tuple[str, ...], package: str) -> Path:
    """Path to `venv`'s python, creating it once (a few minutes): our torch, `pins`, then `package` --no-deps."""

    def install(pip: list[str]) -> None:
        subprocess.run([*pip, _torch_requirement(), *pins], check=True)
        subprocess.run([*pip, "--no-deps", package], check=True)

    return cached_venv(venv, label, install)


def run_in(python: Path, script: str, *args: str, timeout: float = 1200, preload: tuple[str, ...] = ()) -> str:
    """Run `tests/oracle/<script>` with `python` (an oracle venv's); returns its stdout, raises with its stderr.
    The run is a fork of a process of that venv that imported `preload` once (tests/forkserver.py)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(HERE))
    proc = forkserver.run([str(python), str(HERE / script), *args], env=env, timeout=timeout, preload=preload)
    if proc.returncode != 0:
        raise RuntimeError(f"oracle script {script} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc.stdout


def oracle_venv_dir() -> Path:
    return venv_dir("QWEN3_TTS_ORACLE_VENV", "oracle", ORACLE_PINS, ORACLE_PACKAGE)


def oracle_python() -> Path:
    """Path to the oracle venv's python, creating the venv once (a few minutes)."""
    return venv_python(oracle_venv_dir(), "oracle", ORACLE_PINS, ORACLE_PACKAGE)


def run_oracle(script: str, *args: str, timeout: float = 1200) -> str:
    """Run `tests/oracle/<script>` inside the oracle venv; returns its stdout, raises with its stderr."""
    return run_in(oracle_python(), script, *args, timeout=timeout, preload=("official_import",))
