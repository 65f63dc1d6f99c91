"""The project's Triton kernels on CPU: Triton's interpreter (`TRITON_INTERPRET=1`) in a cached virtualenv.

The kernels run on CUDA only, and the main env of a CPU machine has no Triton. Triton's interpreter runs a
kernel's program instances one by one with numpy, so CPU CI checks what a kernel computes (in fp32: the
interpreter has no bf16 arithmetic) before a GPU session measures how fast it runs. The venv is created on first
use (`--system-site-packages`: it adds only Triton to the main env's packages; needs PyPI once) and cached under
`$QWEN3_TTS_TRITON_VENV` (default `~/.cache/qwen3-tts-serve/triton-interp-<hash>`). Scripts in
`tests/interpreted/` run inside it with `run_interpreted(script)` and print their measurements as JSON; the
tests assert on them. The same venv also compiles the kernels for sm_90 without a GPU (Triton's compiler and
its bundled ptxas: `tests/interpreted/compile_sm90.py`), which catches what the interpreter cannot (a kernel
that does not compile, a tile that spills registers).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from tests import forkserver
from tests.cached_venv import cached_venv

TRITON_PIN = "triton==3.6.0"  # the GPU image's Triton (torch 2.11.0+cu130)
HERE = Path(__file__).resolve().parent
INTERPRETER_PRELOAD = ("numpy", "torch", "triton", "triton.runtime.interpreter")
REPO = HERE.parent


def interpreter_venv_dir() -> Path:
    key = hashlib.sha256(f"{TRITON_PIN}\n{sys.version}".encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "qwen3-tts-serve" / f"triton-interp-{key}"
    return Path(os.environ.get("QWEN3_TTS_TRITON_VENV", default))


def interpreter_python() -> Path:
    """Path to the venv's python, creating the venv once."""
    return cached_venv(interpreter_venv_dir(), "triton",
                       lambda pip: subprocess.run([*pip, TRITON_PIN], check=True), system_site_packages=True)


def run_interpreted(script: str, *args: str, interpret: bool = True, timeout: float = 600) -> dict:
    """Run `tests/interpreted/<script>` in the venv, under Triton's interpreter (or, `interpret=False`, with
    Triton compiling for a GPU it does not need to see); returns the JSON it prints last."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    cmd = [str(interpreter_python()), str(HERE / "interpreted" / script), *args]
    if interpret:  # a fork of one process that imported torch and Triton (as interpreter) once: tests/forkserver.py
        proc = forkserver.run(cmd, env=env, timeout=timeout, cwd=REPO, preload=INTERPRETER_PRELOAD)
    else:  # the compiling runs go two at a time, and Triton chooses interpreter or compiler at its import
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
