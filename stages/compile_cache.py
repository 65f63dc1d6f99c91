"""CompileCache: torch.compile's work kept in one file, loaded before the first compile and written after the
first warm-up, so later starts (another replica, a restarted pod, a new machine reading the same shared
directory) skip Inductor's code generation and Triton's kernel compilation.

It stores PyTorch's portable cache artifacts (`torch.compiler.save_cache_artifacts`: the FX graph, autotuning and
Triton kernel caches of everything compiled in the process) and, with Dynamo's caching precompile on (what `load`
turns on), Dynamo's own work too: each compiled function's guards and bytecode, so a start from the file does not
trace the functions again. Tracing was what a start from the file still spent its time on: ~40 compiled variants
(talker and code predictor, batch 1 and wider, one row, two and prompt widths), 35 s of the talker's start on an H100
(bench/startup.py). That mode drops guards on globals (which function a name refers to), so the file name keys the
source of the compiled code as well as the torch, Triton and CUDA versions, the GPU, the model's shapes and torch's
intra-op thread count (Dynamo guards every compiled variant on the process's global state, the thread count included:
work traced under another count fails its guards and is traced and compiled again; a replica's count is its
OMP_NUM_THREADS, which the shipped configs set to 1 and Ray otherwise sets to its `num_cpus`): an incompatible file is
never offered; a file that is not useful is harmless (PyTorch checks its own cache keys entry by entry). A start that
loaded the file and compiled something it lacked (a shape variant, a kernel option the key does not name) writes it
again with both, so the next start has all of it: PyTorch's own save returns only what this process recorded (a
variant served by Dynamo's loaded work records nothing, so its Inductor and AOTAutograd artifacts were dropped from a
rewritten file: 21.5 -> 3.7 MiB on an H100), and `save` merges it into the file as it is then (`_merged`), so a file
only grows. Writes are atomic: replicas starting together may race, and the last complete file wins (it holds what it
read, and what its writer added). Two engines whose compiled functions see different shapes must not share a file
(Dynamo's work for a function is one artifact, and each would replace the other's): the key names what decides the
shapes (`model_key`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch._dynamo
from torch._dynamo.utils import counters

try:
    import triton
except ImportError:  # CPU-only installs
    triton = None


class CompileCache:
    def __init__(self, path: Path, dynamo: bool = True):
        self.path = path
        self.dynamo = dynamo  # also keep Dynamo's work (torch's experimental caching precompile)
        self.loaded = False
        self._work_at_load: tuple[int, int] | None = None  # `_new_work()` when the file was loaded

    @classmethod
    def for_model(cls, directory: str | Path, device: torch.device, model_key: dict,
                  sources: tuple[str | Path, ...] = (), dynamo: bool = True) -> CompileCache:
        """`sources`: the files whose functions are compiled (their bytes are part of the key). `dynamo=False`:
        Inductor's artifacts only (each start traces its functions again), a separate file."""
        code = hashlib.sha256(b"".join(Path(f).read_bytes() for f in sources)).hexdigest()[:16] if sources else None
        key = {
            "torch": torch.__version__, "triton": getattr(triton, "__version__", None), "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type, "code": code,
            "dynamo": dynamo, "torch_threads": torch.get_num_threads(), **model_key,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return cls(Path(directory).expanduser() / f"torch-compile-{digest}.bin", dynamo)

    def load(self, log: Callable[[str], None]) -> bool:
        """Hand the file's artifacts to torch.compile (before the first compile). Returns whether it did.

        With `dynamo`, turns Dynamo's caching precompile on for the process first (where this torch has it), so
        that this start also writes Dynamo's work to the file, or reads it from there: only for functions that
        torch.compile wraps after this call (it reads the switch when it wraps; stages/code2wav/compiled.py wraps
        at the first call for that reason, the Talker's runner is built after the load)."""
        if self.dynamo and hasattr(torch._dynamo.config, "caching_precompile"):
            torch._dynamo.config.caching_precompile = True
            _fresh_dynamo_names()
        if not self.path.is_file():
            log(f"[compile-cache] none at {self.path}: this start compiles and writes it")
            return False
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as e:  # a truncated or foreign file must not stop the start: compile instead
            info, error = None, e
        else:
            error = "no artifacts in it"
        if info is None:
            log(f"[compile-cache] could not load {self.path} ({error}): compiling")
            return False
        self.loaded = True
        self._work_at_load = self._new_work()
        log(f"[compile-cache] loaded {self.path} ({self.path.stat().st_size / 2**20:.1f} MiB)")
        return True

    def save(self, log: Callable[[str], None]) -> bool:
        """Write what this process compiled into the file, merged with what the file holds by then (`_merged`),
        unless the file was loaded and nothing was compiled since that it lacked (a shape variant, a kernel option).
        Returns whether it wrote."""
        work = self._new_work()
        if self.loaded and work == self._work_at_load:
            return False
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        data, _info = artifacts
        try:
            current = self.path.read_bytes() if self.path.is_file() else None
        except OSError as e:  # unreadable now (permissions, a shared volume's hiccup): this start's work alone
            log(f"[compile-cache] could not read {self.path} to merge ({e!r})")
            current = None
        data = _merged(current, data, log)
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a unique name in the same directory: replicas of several machines may share it (their pids may match)
            fd, tmp = tempfile.mkstemp(prefix=f"{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only or full cache directory costs the next start time, nothing else
            log(f"[compile-cache] could not write {self.path}: {e!r}")
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return False
        beyond = ""
        if self.loaded:
            traces, compiles = (now - then for now, then in zip(work, self._work_at_load, strict=True))
            beyond = f", with what this start compiled beyond the file it loaded: {traces} traces, {compiles} graphs"
        log(f"[compile-cache] wrote {self.path} ({len(data) / 2**20:.1f} MiB{beyond})")
        return True

    def _new_work(self) -> tuple[int, int]:
        """Process-wide counts of work a file would save the next start: Dynamo's traces (where the file keeps
        them; without Dynamo's work every start traces again) and Inductor's compiled graphs."""
        return (counters["stats"]["unique_graphs"] if self.dynamo else 0, counters["inductor"]["fxgraph_cache_miss"])


def _merged(current: bytes | None, new: bytes, log: Callable[[str], None]) -> bytes:
    """The artifacts of `current` (a file's bytes, or None) with those of `new` added; of two with the same type and
    key, `new`'s (Dynamo's work for a function holds every variant this process has of it, loaded ones included).
    Of `new`, one batch of each type, the last (torch's own reader keeps one): torch's save returns all that the
    process serialized so far, so the bytes of a second cache in one process (the Talker's first-chunk decoder
    after the Talker) began with the first one's artifacts (a 55.5 MiB file for 6 MiB of its own); a type that the
    second cache records none of still comes from the first (small: autotune results). The file only grows: an
    entry no start uses any more stays until the key changes (torch, the compiled source, the shapes).

    torch keeps this format private (`torch.compiler._cache`: a list of (type, artifacts) pairs, which torch's
    own loader turns into a dict, so two files cannot simply be concatenated); a torch whose format this does not
    read gets `new` alone, as before. tests/stages/test_compile_cache.py fails if a torch upgrade breaks it."""
    try:
        from torch.compiler._cache import _serialize_single_cache
        from torch.utils._appending_byte_serializer import AppendingByteSerializer

        merged, added = (_artifacts(current) if current is not None else {}), _artifacts(new)
        for kind, artifacts in added.items():
            by_key = {a.key: a for a in merged.get(kind, [])}
            by_key.update({a.key: a for a in artifacts})
            merged[kind] = list(by_key.values())
        writer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
        writer.extend(merged.items())
        return writer.to_bytes()
    except Exception as e:  # the file keeps this start's work, as torch's own save would
        log(f"[compile-cache] could not merge with the file ({e!r}): writing this start's work alone")
        return new


def _artifacts(data: bytes) -> dict[str, list]:
    """A file's artifacts by type ("inductor", "aot_autograd", "precompile", ...), each with `key` and `content`."""
    from torch.compiler._cache import CacheArtifactManager

    artifacts = CacheArtifactManager.deserialize(data)
    if artifacts is None:
        raise ValueError("unreadable artifacts")
    return artifacts


def contents(path: Path) -> dict[str, tuple[int, int]]:
    """What a cache file holds: artifact type -> (count, bytes)."""
    return {kind: (len(items), sum(len(a.content) for a in items))
            for kind, items in _artifacts(Path(path).read_bytes()).items()}


def _fresh_dynamo_names() -> None:
    """Start Dynamo's process-wide name counter at a random offset, so that a function traced anew after a load
    (a shape variant the file lacks) cannot take a name the loaded work already put into its module's globals.

    Why: each trace installs its builtins as `__builtins_dict___<n>` in the traced function's module, with n from a
    counter that starts at 0 in every process; loading Dynamo's caching precompile installs the writing process's
    names there too, untracked, so the first new trace in that module failed with "Name '__builtins_dict___0'
    already exists in scope" (torch 2.11 and 2.13, torch/_dynamo/bytecode_transformation.py `_unique_id_counter`,
    package.py `CompilePackage.install`). Private, so kept here alone; tests/stages/test_compile_cache.py fails if a
    torch upgrade drops it."""
    import itertools
    import random

    from torch._dynamo import bytecode_transformation

    if hasattr(bytecode_transformation, "_unique_id_counter"):
        bytecode_transformation._unique_id_counter = itertools.count(random.SystemRandom().randrange(1 << 32, 1 << 62))


if __name__ == "__main__":  # python -m stages.compile_cache DIR_OR_FILE...: what each cache file holds
    import sys

    for arg in sys.argv[1:]:
        path = Path(arg).expanduser()
        for file in sorted(path.glob("torch-compile-*.bin")) if path.is_dir() else [path]:
            try:
                parts = ", ".join(f"{kind} {n} ({size / 2**20:.1f} MiB)" for kind, (n, size) in contents(file).items())
            except Exception as e:  # one unreadable file: say so, list the others
                parts = f"unreadable ({e!r})"
            print(f"{file.name}: {file.stat().st_size / 2**20:.1f} MiB: {parts}")
