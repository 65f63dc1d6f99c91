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
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tests.cached_venv import cached_venv

TRITON_PIN = "triton==3.6.0"  # the GPU image's Triton (torch 2.11.0+cu130)
HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def interpreter_venv_dir() -> Path:
    key = hashlib.sha256(f"{TRITON_PIN}\n{sys.version}".encode()).hexdigest()[:12]
    default = Path.home() / ".cache" / "qwen3-tts-serve" / f"triton-interp-{key}"
    return Path(os.environ.get("QWEN3_TTS_TRITON_VENV", default))


def interpreter_python() -> Path:
    """Path to the venv's python, creating the venv once."""
    return cached_venv(interpreter_venv_dir(), "triton",
                       lambda pip: subprocess.run([*pip, TRITON_PIN], check=True), system_site_packages=True)


# The scripts of each test module, started in the background once the session has collected that module
# (tests/conftest.py `pytest_collection_finish`): each is a single-threaded subprocess of several seconds to a minute,
# and most of the suite's other tests leave the second core idle, so they run beside the tests before theirs and the
# test then only reads its result. One at a time, in this order; `run_interpreted` takes a prefetched result when its
# call is here (same script, arguments and mode), else runs the script itself.
PREFETCH = {
    "tests/stages/test_triton_compile.py": (("compile_sm90.py", ("gemv",), False),
                                            ("compile_sm90.py", ("attention", "sampling", "window_products"), False)),
    "tests/stages/test_heads_in_attention.py": (("heads_in_attention.py", (), True),),
    "tests/stages/test_frame_kernels.py": (("frame.py", (), True),),
    "tests/stages/test_gemv.py": (("gemv.py", (), True),),
    "tests/stages/test_sampling_kernel.py": (("sampling_kernel.py", (), True),),
    "tests/stages/test_invariant_conv.py": (("window_product.py", (), True),),
    "tests/stages/test_decode_attention_kernels.py": (("decode_attention.py", (), True),),
}
PREFETCH_TIMEOUT_S = 1200
_prefetched: dict[tuple, Future] = {}
_pool: ThreadPoolExecutor | None = None
_running: set[subprocess.Popen] = set()
_stopping = False


def prefetch(test_modules: set[str]) -> int:
    """Start, in one background thread, the scripts of the given test modules (paths relative to the repository);
    returns how many calls were queued."""
    global _pool
    calls = [call for module, module_calls in PREFETCH.items() if module in test_modules for call in module_calls]
    if calls and _pool is None:
        _pool = ThreadPoolExecutor(1, thread_name_prefix="interpreted-prefetch")
    for script, args, interpret in calls:
        _prefetched[(script, args, interpret)] = _pool.submit(_run, script, args, interpret, PREFETCH_TIMEOUT_S)
    return len(calls)


def stop_prefetch() -> None:
    """At the session's end: drop what has not started and stop what runs (a session ended early must not wait)."""
    global _stopping
    _stopping = True
    for future in _prefetched.values():
        future.cancel()
    for proc in list(_running):
        proc.kill()
    _prefetched.clear()


def run_interpreted(script: str, *args: str, interpret: bool = True, timeout: float = 600) -> dict:
    """Run `tests/interpreted/<script>` in the venv, under Triton's interpreter (or, `interpret=False`, with
    Triton compiling for a GPU it does not need to see); returns the JSON it prints last."""
    future = _prefetched.pop((script, tuple(args), interpret), None)
    if future is not None and not future.cancelled():
        return future.result()
    return _run(script, tuple(args), interpret, timeout)


def _run(script: str, args: tuple[str, ...], interpret: bool, timeout: float) -> dict:
    if _stopping and threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the session ended")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.Popen([str(interpreter_python()), str(HERE / "interpreted" / script), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    _running.add(proc)
    if _stopping and threading.current_thread() is not threading.main_thread():
        proc.kill()  # the session ended while it started
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        _running.discard(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed ({proc.returncode}):\n{stderr[-6000:]}")
    return json.loads(stdout.strip().splitlines()[-1])
