"""How many Triton kernels this process has JIT-compiled: the project's own `@triton.jit` kernels compile per
specialization (dtypes, constexprs, which integer arguments are 1 or multiples of 16, pointer alignment) when a
launch first meets it, so a shape with a new specialization costs a compile (about a second) in that call. A server
reads `compiled()` around a request's forward to say whether it paid one (the Aligner's slow-forward log line).

`install()` chains a counting hook onto Triton's `knobs.runtime.jit_post_compile_hook` (called after every JIT
compile, a compile served from Triton's disk cache included, so after a warm-up a count that moves means a
specialization the warm-up missed). Inductor's kernels are not counted: they compile when torch.compile generates
them (Dynamo's counters say so). Without Triton (CPU installs) the count stays 0.
"""

from __future__ import annotations

import threading

try:
    import triton
except ImportError:  # CPU-only installs: nothing compiles
    triton = None


class _Counter:
    def __init__(self):
        self.count = 0
        self.installed = False
        self.lock = threading.Lock()

    def hook(self, previous):
        def counting(*args, **kwargs):
            with self.lock:
                self.count += 1
            return previous(*args, **kwargs) if previous is not None else None
        return counting


_counter = _Counter()  # Triton's hook is process-wide, so is its count


def install() -> None:
    """Start counting (idempotent; keeps a hook someone else set, called after the count)."""
    with _counter.lock:
        if _counter.installed or triton is None:
            return
        runtime = triton.knobs.runtime
        runtime.jit_post_compile_hook = _counter.hook(runtime.jit_post_compile_hook)
        _counter.installed = True


def compiled() -> int:
    """Triton JIT compiles since `install()`."""
    return _counter.count
