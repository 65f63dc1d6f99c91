"""bench/gpu_serve_runbook.sh's launch on a multi-GPU host: one raylet per GPU, each advertising its role.

`ray`, `serve` and the GPUs are stand-ins (commands on PATH that record how they were called), so this runs on
CPU: what is checked is the placement the script asks Ray for, which the 4-GPU split and replicas runs rely on.
"""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from tests.bench import REPO


def _launch(tmp_path, gpu_resources: str | None) -> list[str]:
    bin_dir, w = tmp_path / "bin", tmp_path / "w"
    bin_dir.mkdir()
    w.mkdir()
    calls = tmp_path / "calls.log"
    for name in ("ray", "serve"):  # each call: its name, the GPUs it may see, its arguments
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} [${{CUDA_VISIBLE_DEVICES:-}}] $*" >> "{calls}"\n')
        tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    (w / "serve.yaml").write_text("ray_actor_options: {resources: {gpu_0: 1}}\n")  # a config that places by GPU
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "W": str(w), "OUT": str(tmp_path / "out"),
           "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    env.pop("GPU_RESOURCES", None)
    if gpu_resources is not None:
        env["GPU_RESOURCES"] = gpu_resources
    subprocess.run(["bash", "bench/gpu_serve_runbook.sh", "_launch"], cwd=REPO, env=env, check=True, timeout=60)
    return calls.read_text().splitlines()


@pytest.mark.parametrize("roles, expected", [
    (None, ["gpu_0", "gpu_1", "gpu_2", "gpu_3"]),  # pinned by device index (split.yaml on 2 GPUs, replicas.yaml)
    ("gpu_0 gpu_0 gpu_1 gpu_1", ["gpu_0", "gpu_0", "gpu_1", "gpu_1"]),  # two Talker GPUs, two Code2Wav GPUs
])
def test_each_gpus_raylet_advertises_its_role(tmp_path, roles, expected):
    calls = _launch(tmp_path, roles)
    head, *workers, serve = calls
    assert head.startswith("ray [0,1,2,3] start --head") and "--num-gpus=0" in head
    assert [w.split("]")[0] + "]" for w in workers] == [f"ray [{k}]" for k in range(4)]  # one GPU each
    assert [w.split('--resources={"')[1].split('"')[0] for w in workers] == expected
    assert serve.startswith("serve [0,1,2,3] run --address=127.0.0.1:6379")


def test_variants_refuse_an_unknown_name_and_list_the_known_ones(tmp_path):
    """`variants NAME...` runs each served or in-process variant; a name it does not know stops the run (exit 2)
    before anything starts, and the message lists the variants that exist."""
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "bench/gpu_serve_runbook.sh", "variants", "ingress4"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown variant ingress4 (mps serve readme objref inproc gpu1 replicas split)" in done.stdout
    assert not (tmp_path / "out" / "ingress4.tar.gz").exists()
