"""bench/compile_profile.py (`bench/startup.py --profile`) counts the compiles made while it is installed, and only
those, and leaves the patched functions as they were once uninstalled."""

from __future__ import annotations

import torch

from bench.compile_profile import CompileProfile


def _scaled_sine(x):
    return (x * 2).sin()


def test_dynamo_compiles_while_installed_are_counted_and_uninstall_restores_the_originals():
    torch.compile(_scaled_sine, backend="eager", dynamic=True)(torch.randn(4))  # before: not counted
    profile = CompileProfile()
    originals = {name: getattr(cls, name) for cls, name in _patched()}
    profile.install()
    assert profile._undo, "nothing was patched: Inductor's autotuner at least must be there"
    f = torch.compile(lambda x: (x + 1).cos(), backend="eager", dynamic=True)
    f(torch.randn(4))
    f(torch.randn(1))  # a size of 1 is specialized: a second compile
    report = profile.report()
    profile.uninstall()
    assert report["dynamo_compiles"] == 2
    assert report["dynamo_s"]["_compile.compile_inner"] > 0
    assert report["inductor_autotune"] == {"benchmarks": 0, "seconds": 0.0}  # the eager backend generates no kernels
    assert {name: getattr(cls, name) for cls, name in _patched()} == originals


def _patched():
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    pairs = [(CachingAutotuner, "benchmark_all_configs")]
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return pairs
    return pairs + [(JITFunction, "_do_compile")]
