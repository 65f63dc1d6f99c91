"""stages/jit_compiles.py: the count of Triton JIT compiles. CPU installs have no Triton, so this drives the hook
the way Triton's JIT calls it after a compile (`knobs.runtime.jit_post_compile_hook(**kwargs)`), on a stand-in for
`triton.knobs`; on a GPU the Aligner's slow-forward log and replica stats (`late_kernels`) use it for real."""

from __future__ import annotations

import types

from stages import jit_compiles


def test_counts_every_compile_once_installed_and_keeps_a_hook_already_set(monkeypatch):
    seen = []
    runtime = types.SimpleNamespace(jit_post_compile_hook=lambda **kw: seen.append(kw["key"]))
    monkeypatch.setattr(jit_compiles, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(jit_compiles, "_counter", jit_compiles._Counter())
    assert jit_compiles.compiled() == 0
    jit_compiles.install()
    jit_compiles.install()  # idempotent: one counting hook
    for key in ("a", "b", "c"):
        runtime.jit_post_compile_hook(key=key, repr="kernel[...]", already_compiled=False)
    assert jit_compiles.compiled() == 3
    assert seen == ["a", "b", "c"]  # the hook set before still runs, once per compile


def test_without_triton_install_does_nothing(monkeypatch):
    monkeypatch.setattr(jit_compiles, "triton", None)
    monkeypatch.setattr(jit_compiles, "_counter", jit_compiles._Counter())
    jit_compiles.install()
    assert jit_compiles.compiled() == 0
