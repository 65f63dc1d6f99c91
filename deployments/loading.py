"""Getting a checkpoint onto a replica: the embedded tiny checkpoint, device/dtype choice, engine classes.

The embedded default (`model: null`) writes a tiny random checkpoint once into
`~/.cache/qwen3-tts-serve/embedded/<kind>-<size>-tiny` (under a file lock, so the Talker and Code2Wav
replicas starting together write it once) and serves it: `serve run configs/local.yaml` works on a
fresh machine with nothing downloaded. The Aligner's embedded default is `embedded/aligner-tiny`, likewise.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from deployments import constants as C
from deployments.config import CheckpointSource, _RuntimeOptions
from deployments.config.common import _DeviceOptions

Log = Callable[[str], None]
logger = logging.getLogger("ray.serve")


def this_replica() -> str | None:
    """This Serve replica's unique id (which replica answered a stats call); None outside a replica (a server
    class built directly, as in tests)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return None


def replica_log(prefix: str) -> Log:
    """A `log` callable for the stages' loaders: start-up progress reaches the `serve run` console.

    Serve's logger writes to stderr (which Ray forwards to the console) unless the cluster runs with
    `RAY_SERVE_LOG_TO_STDERR=0`, which `RAY_SERVE_THROUGHPUT_OPTIMIZED=1` implies; then the lines also go to the
    process's own stdout, or a two-minute start-up would print nothing until "ready". Its own: in that mode a
    replica's `print` and `sys.stdout` go to Serve's logger too (ray/serve/_private/logging_utils.py), which
    keeps up to 1,000 records before it writes its file and never reaches the console.
    """
    to_stdout = not serve_logs_to_stderr()

    def log(message: str) -> None:
        logger.info(f"[{prefix}] {message}")
        if to_stdout:
            # written, not printed: Serve's replacement `print` prints a tuple when given a file (Ray 2.60)
            stream = sys.__stdout__ or sys.stdout
            stream.write(f"[{prefix}] {message}\n")
            stream.flush()

    return log


def serve_logs_to_stderr(env: dict[str, str] | None = None) -> bool:
    """Serve's own rule (ray/serve/_private/constants.py, Ray 2.60: only "1" is true), from the public variables."""
    env = os.environ if env is None else env
    default = "0" if env.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0") == "1" else "1"
    return env.get("RAY_SERVE_LOG_TO_STDERR", default) == "1"


def checkpoint_location(source: CheckpointSource, log: Log = print) -> str:
    """A path or Hugging Face id that `Qwen3TTS.load` accepts; writes the embedded checkpoint if needed.

    `~` in `model` is expanded here, in the replica (`${VAR:-default}` was, where the config was validated:
    deployments/config.substitute_env).
    """
    if not source.embedded:
        return os.path.expanduser(str(source.model))
    return str(ensure_embedded_checkpoint(source.embedded_kind, source.embedded_size, log=log))


def ensure_embedded_checkpoint(kind: str, size: str = "1.7b", root: Path | None = None, log: Log = print) -> Path:
    def write(tmp: Path) -> None:
        from stages.random_checkpoint import write_random_checkpoint

        log(f"[embedded] no checkpoint configured: writing a tiny random {kind} checkpoint into {tmp.parent} "
            "(random weights: the audio is noise; set `model:` to serve a real checkpoint)")
        write_random_checkpoint(tmp, size, kind, tiny=True, dtype="float32", seed=0, log=log)

    return _written_once(root, f"{kind}-{size.replace('.', '')}-tiny", write, log)


def ensure_embedded_aligner(root: Path | None = None, log: Log = print) -> Path:
    """The embedded tiny random aligner (`aligner.model: null`): the timestamps API works end to end, the times
    mean nothing."""
    def write(tmp: Path) -> None:
        from stages.aligner.random_checkpoint import write_random_aligner

        log(f"[embedded] no aligner configured: writing a tiny random aligner checkpoint into {tmp.parent} "
            "(random weights: the times are meaningless; set `aligner.model:` to serve a real one)")
        write_random_aligner(tmp, tiny=True, dtype="float32", seed=0, log=log)

    return _written_once(root, "aligner-tiny", write, log)


def aligner_location(model: str | None, log: Log = print) -> str:
    """A path or Hugging Face id that `stages.aligner.Aligner.load` accepts; writes the embedded one if needed."""
    return os.path.expanduser(model) if model else str(ensure_embedded_aligner(log=log))


def _written_once(root: Path | None, name: str, write: Callable[[Path], None], log: Log) -> Path:
    """`root/name`, written by `write(tmp)` unless it exists: under a file lock, so the replicas starting together
    write it once, and renamed into place whole (config.json appears only with a complete checkpoint)."""
    root = Path(root) if root is not None else C.EMBEDDED_CHECKPOINT_DIR
    out = root / name
    if (out / "config.json").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another replica may be writing it right now
        if (out / "config.json").exists():
            return out
        t0 = time.perf_counter()
        tmp = root / f".{name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        write(tmp)
        os.replace(tmp, out)
        log(f"[embedded] checkpoint ready in {time.perf_counter() - t0:.1f} s")
    return out


def resolve_device_dtype(options: _DeviceOptions) -> tuple[str, str]:
    import torch

    device = options.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = options.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return device, dtype


def keep_triton_kernels(env: MutableMapping[str, str] = os.environ) -> str:
    """Point Triton's cache at C.TRITON_CACHE_DIR unless the environment names one; returns the one in use.

    Why: with Triton's default cache empty, a served start from the compile-cache file still compiles the vocoder
    kernels of every first-chunk decoder graph, per shape family (seconds; docs/benchmarks.md "Ready")."""
    return env.setdefault("TRITON_CACHE_DIR", str(C.TRITON_CACHE_DIR))


def keep_bytecode(probe: str = "torch", pycache_dir: str = C.PYCACHE_DIR) -> str | None:
    """Keep the bytecode of modules imported from here on under `pycache_dir` when the installed `probe` package
    carries none where Python looks (installed without bytecode, as uv does by default, and often run with
    PYTHONDONTWRITEBYTECODE=1, as container images set it): then every replica start compiles torch, Triton and
    sympy from source again, seconds of a GPU replica's start (docs/benchmarks.md, "Ready").
    Bytecode goes to that directory only (the installed packages stay untouched), beside the compile cache, so a
    restart or another machine sharing the directory reads it. Returns the prefix in use, or None if nothing was
    changed (bytecode present, a prefix already set by PYTHONPYCACHEPREFIX, `pycache_dir` "off", or no `probe`)."""
    import importlib.util
    import sys

    if pycache_dir == "off" or sys.pycache_prefix is not None:
        return None
    spec = importlib.util.find_spec(probe)  # a top-level package: found without importing it
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None  # the package has its bytecode
    sys.pycache_prefix = pycache_dir
    sys.dont_write_bytecode = False  # writes go to pycache_dir only
    return pycache_dir


def configure_torch(options: _DeviceOptions, device: str) -> None:
    """Per-process settings: CPU threads, a GPU memory cap (fractional GPUs share memory) and Triton's cache."""
    import torch

    keep_triton_kernels()
    if options.cpu_threads is not None:
        torch.set_num_threads(options.cpu_threads)
    if options.gpu_memory_fraction is not None and device.startswith("cuda"):
        index = torch.device(device).index  # "cuda" alone names no index; torch wants one here
        torch.cuda.set_per_process_memory_fraction(
            options.gpu_memory_fraction, torch.cuda.current_device() if index is None else index
        )


async def load_model(options: _RuntimeOptions, source: CheckpointSource, log: Log, **parts: bool) -> tuple[Any, str]:
    """Resolve the checkpoint, pick device/dtype, configure torch and load the asked-for parts off the loop.

    Returns (the loaded `stages.qwen3_tts.Qwen3TTS`, device). `parts`: talker=, decoder=, voice=.
    """
    import asyncio

    if (prefix := keep_bytecode()) is not None:
        log(f"bytecode of the modules imported from here on kept in {prefix} (the installed packages have none)")
    from stages.qwen3_tts import Qwen3TTS  # torch, Triton...

    path = await asyncio.to_thread(checkpoint_location, source, log)
    device, dtype = resolve_device_dtype(options)
    configure_torch(options, device)
    if options.engine_config_kwargs().get("deterministic") and device.startswith("cuda"):
        from stages import row_invariant_products  # before the process's first product (the load runs some)

        row_invariant_products.use_no_workspace()
    model = await asyncio.to_thread(Qwen3TTS.load, path, device, dtype, log=log, **parts)
    return model, device


# The built-in engines' config dataclasses, in modules without torch: the application builder validates
# `engine_kwargs` with them in Serve's build worker, on `serve run`'s path to ready, without importing torch there.
# Any other engine is imported and names its config in its `config_cls` attribute.
ENGINE_CONFIGS = {
    "stages.talker.engine:TalkerEngine": "stages.talker.engine_config:TalkerEngineConfig",
    "stages.code2wav.engine:Code2WavEngine": "stages.code2wav.engine_config:Code2WavEngineConfig",
}


def engine_config(engine_path: str, engine_kwargs: dict[str, Any]) -> Any:
    """-> the config of the engine that `engine_path` names. Unknown or invalid `engine_kwargs` raise ValueError."""
    if engine_path in ENGINE_CONFIGS:
        config_cls = import_object(ENGINE_CONFIGS[engine_path])
    else:
        config_cls = getattr(import_object(engine_path), "config_cls", None)
        if config_cls is None:
            raise ValueError(f"engine {engine_path} has no `config_cls` attribute (the dataclass of its engine_kwargs)")
    try:
        return config_cls(**engine_kwargs)
    except TypeError as e:
        raise ValueError(f"engine_kwargs for {engine_path}: {e}") from None


def build_engine(engine_path: str, model: Any, engine_kwargs: dict[str, Any]) -> Any:
    engine_cls = import_object(engine_path)
    return engine_cls(model, engine_config(engine_path, engine_kwargs))


def import_object(path: str) -> Any:
    """'package.module:Name' (or 'package.module.Name') -> the object."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    return getattr(importlib.import_module(module), name)
