"""bench/soak.py samples the memory of the GPUs its server may use: with CUDA_VISIBLE_DEVICES set (a soak pinned to
one GPU of several, bench/gpu_soak.sh) only those, so other work on the host's other GPUs does not count."""

from __future__ import annotations

import shutil
import subprocess
import types

from bench import soak


def _calls(monkeypatch, visible: str | None) -> tuple[list[list[str]], list[float]]:
    calls: list[list[str]] = []

    def run(cmd, **_kwargs):
        calls.append(cmd)
        return types.SimpleNamespace(stdout="1234\n" if "-i" in cmd else "1234\n5678\n")

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(subprocess, "run", run)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    return calls, soak.gpu_mem_mib()


def test_every_gpu_without_cuda_visible_devices(monkeypatch):
    calls, mib = _calls(monkeypatch, None)
    assert "-i" not in calls[0] and mib == [1234.0, 5678.0]


def test_only_the_visible_gpus_when_set(monkeypatch):
    calls, mib = _calls(monkeypatch, "1")
    assert calls[0][-2:] == ["-i", "1"] and mib == [1234.0]
