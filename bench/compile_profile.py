"""CompileProfile: where a start's compile time goes, for `bench/startup.py --profile`.

Three counters over one process, none of which changes what is compiled:
- the Triton JIT compiles of the project's own kernels (paged attention, GEMVs, sampling, the vocoder's): each one
  is compiled in the thread that first launches it, one after the other, so their sum is start-up time spent
  serially (`JITFunction._do_compile`, timed per kernel);
- Inductor's autotuning of its generated kernels (`CachingAutotuner.benchmark_all_configs`);
- Dynamo's own phase timers (`torch._dynamo.utils.compile_times`: tracing, AOTAutograd, Inductor's code generation,
  the wait for its parallel kernel compiles), summed over every function compiled.

The two patches wrap private functions of Triton and Inductor; where a version lacks one, that counter is absent
from the report rather than wrong.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

# Dynamo's timers that say where a compile's time goes (the rest are sub-passes of these)
_DYNAMO_PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function",
                  "aot_collect_metadata", "compile_fx.<locals>.fw_compiler_base", "GraphLowering.codegen",
                  "async_compile.wait", "PyCodeCache.load_by_key_path", "build_guards")


class CompileProfile:
    def __init__(self) -> None:
        self.triton: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # kernel -> [compiles, seconds]
        self.autotune = [0, 0.0]
        self._undo: list = []
        self._dynamo_at_install: dict[str, int] = {}  # Dynamo's timers are process-wide: count from install on

    def install(self) -> CompileProfile:
        metrics = _dynamo_metrics()
        self._dynamo_at_install = {name: len(times) for name, times in (metrics or {}).items()}
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            pass
        else:
            self._wrap(JITFunction, "_do_compile",
                       lambda kernel: self.triton[getattr(kernel.fn, "__qualname__", repr(kernel))])
        try:
            from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        except ImportError:
            pass
        else:
            self._wrap(CachingAutotuner, "benchmark_all_configs", lambda _: self.autotune)
        return self

    def _wrap(self, cls: type, name: str, counter) -> None:
        original = getattr(cls, name, None)
        if original is None:
            return

        def timed(obj, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(obj, *args, **kwargs)
            finally:
                entry = counter(obj)
                entry[0] += 1
                entry[1] += time.perf_counter() - t0

        setattr(cls, name, timed)
        self._undo.append((cls, name, original))

    def uninstall(self) -> None:
        for cls, name, original in reversed(self._undo):
            setattr(cls, name, original)
        self._undo.clear()

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self._undo:
            kernels = sorted(self.triton.items(), key=lambda kv: -kv[1][1])
            out["triton_jit"] = {"compiles": sum(n for n, _ in self.triton.values()),
                                 "seconds": round(sum(s for _, s in self.triton.values()), 2),
                                 "by_kernel": {k: {"compiles": n, "seconds": round(s, 2)} for k, (n, s) in kernels}}
            out["inductor_autotune"] = {"benchmarks": self.autotune[0], "seconds": round(self.autotune[1], 2)}
        metrics = _dynamo_metrics()
        if metrics is None:
            return out
        since = {name: times[self._dynamo_at_install.get(name, 0):] for name, times in metrics.items()}
        out["dynamo_s"] = {name: round(sum(since[name]), 2) for name in _DYNAMO_PHASES if since.get(name)}
        out["dynamo_compiles"] = len(since.get("_compile.compile_inner", []))
        return out


def _dynamo_metrics() -> dict[str, list[float]] | None:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return None
    return compilation_time_metrics
