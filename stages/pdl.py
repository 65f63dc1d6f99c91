"""Programmatic dependent launch (PDL, sm_90+) for the decode step's Triton kernels.

Inside the step's CUDA graph each kernel boundary costs ~1 us between one kernel's end and the next one's start
(launch, then the new programs' prologue). A kernel launched with PDL may start while the kernel before it is
still running: its programs become resident, do what depends on nothing earlier (a GEMV's first weight tile),
and wait in `gdc_wait()` until the previous kernel has completed and its writes are visible. So every kernel
launched this way calls `gdc_wait()` before it reads what an earlier kernel wrote or writes what one may still
read, and `gdc_launch_dependents()` to let the next one launch. Completion is transitive: a kernel completes only
after its own wait returned, so waiting for the previous kernel is waiting for all earlier ones.
"""

from __future__ import annotations

import torch

try:
    import triton
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs: no Triton kernels run
    triton = None


if triton is not None:

    @triton.jit
    def begin():
        """A PDL-launched kernel's first statement when it has nothing to do before its inputs are ready: the next
        kernel may launch now, and this one waits for the previous one. (A GEMV splits the two around its first
        weight tile's load instead.)"""
        gdc_launch_dependents()
        gdc_wait()


def supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_args(pdl: bool) -> dict:
    """A Triton launch's extra keyword arguments (none without PDL: the interpreter knows no launch options)."""
    return {"launch_pdl": True} if pdl else {}
