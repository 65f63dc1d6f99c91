"""`qwen3-tts-serve --prebuild CONFIG` (deployments/launcher/prebuild.py): which replica starts it runs, with the
environment and torch thread count their replicas get, and a real run of `configs/local.yaml` on CPU (the servers'
own start, each in a process of its own). That a prebuilt cache makes a served start warm is measured on a GPU
(docs/results.md, "Start-up"): on CPU nothing is compiled."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from deployments.launcher.prebuild import _run_child, plan

REPO = Path(__file__).resolve().parents[2]


def _config(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


def test_the_shipped_gpu_config_prebuilds_its_talker_then_code2wav_with_one_torch_thread():
    """configs/high_concurrency.yaml has no aligner; configs/local.yaml's comes last (the next test but one)."""
    replicas = plan(_config("high_concurrency.yaml"))
    assert [(r.kind, r.name) for r in replicas] == [("talker", "Talker:qwen3-tts"), ("code2wav", "Code2Wav")]
    for r in replicas:  # the application's env_vars, as Ray gives them to its replicas (OMP_NUM_THREADS=1 there)
        assert r.env == {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_without_omp_in_the_env_a_replica_gets_its_num_cpus_as_ray_sets_it():
    config = _config("high_concurrency.yaml")
    app = config["applications"][0]
    del app["runtime_env"]
    app["deployments"] = [{"name": "Code2Wav", "ray_actor_options": {"num_cpus": 3.5}}]
    threads = {r.name: r.env["OMP_NUM_THREADS"] for r in plan(config, environ={})}
    # the Talker's num_cpus (2) from its deployment_config; Code2Wav's from the top-level `deployments:` override,
    # floored as Ray floors it
    assert threads == {"Talker:qwen3-tts": "2", "Code2Wav": "3"}
    # a count the cluster's environment already sets is what its replicas keep (Ray sets only an unset one)
    assert all("OMP_NUM_THREADS" not in r.env for r in plan(config, environ={"OMP_NUM_THREADS": "4"}))


def test_serve_merges_a_deployments_own_env_and_takes_an_overrides_actor_options_whole():
    config = _config("high_concurrency.yaml")
    app = config["applications"][0]
    del app["runtime_env"]["env_vars"]["OMP_NUM_THREADS"]
    # the Talker's own env_vars over the application's; Code2Wav's override replaces its ray_actor_options whole,
    # so the num_cpus it lacks is Serve's default, 1, not the config's
    app["args"]["models"][0]["deployment_config"]["ray_actor_options"]["runtime_env"] = {
        "env_vars": {"OMP_NUM_THREADS": "6", "TOKENIZERS_PARALLELISM": "true"}}
    app["deployments"] = [{"name": "Code2Wav", "ray_actor_options": {"num_gpus": 0.5}}]
    env = {r.name: r.env for r in plan(config, environ={})}
    assert env["Talker:qwen3-tts"] == {"OMP_NUM_THREADS": "6", "TOKENIZERS_PARALLELISM": "true"}
    assert env["Code2Wav"] == {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_a_variable_only_the_applications_env_vars_define_resolves(monkeypatch):
    monkeypatch.delenv("PREBUILD_TEST_MODEL", raising=False)
    config = _config("high_concurrency.yaml")
    app = config["applications"][0]
    app["args"]["models"][0]["model"] = "${PREBUILD_TEST_MODEL}"
    app["runtime_env"]["env_vars"]["PREBUILD_TEST_MODEL"] = "/models/somewhere"
    assert [r.name for r in plan(config)] == ["Talker:qwen3-tts", "Code2Wav"]
    assert "PREBUILD_TEST_MODEL" not in os.environ  # read under the env_vars, then restored


def test_every_model_of_a_multi_model_config_and_only_build_app_applications():
    config = _config("multi_model.yaml")
    names = [r.name for r in plan(config)]
    models = config["applications"][0]["args"]["models"]
    assert names == [f"Talker:{m['name']}" for m in models] + ["Code2Wav"]
    assert [r.name for r in plan(_config("local.yaml"))] == ["Talker:qwen3-tts", "Code2Wav", "Aligner"]
    config["applications"][0]["import_path"] = "somewhere.else:app"
    assert plan(config) == []


@pytest.mark.slow  # two replica starts of the tiny model, each a fresh Python process
def test_prebuild_of_the_local_config_starts_each_replica_as_its_deployment_does():
    proc = subprocess.run([sys.executable, "-m", "deployments.launcher.serve", "configs/local.yaml", "--prebuild"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    # each server's own start ran (the Talker's warm-up request and first-chunk decoder, Code2Wav's warm-up decode),
    # in a process whose torch has the replica's thread count
    assert "prebuilt Talker:qwen3-tts: engine and first-chunk decoder in" in out
    assert "prebuilt Code2Wav: engine in" in out and "prebuilt Aligner: engine in" in out  # local.yaml has one
    assert out.count("(torch threads 1; ") == 3
    # the Talker and Code2Wav each in an Inductor cache of its own, gone after (a shared one left some of a start's
    # work out of its compile-cache file); the Aligner, which keeps no file, in Inductor's own
    inductor = dict(re.findall(r"prebuilt (\w+)\S*: .*Inductor's cache (\S+)\)", out))
    assert inductor.keys() == {"Talker", "Code2Wav", "Aligner"}, out[-3000:]
    private = [inductor["Talker"], inductor["Code2Wav"]]
    assert len(set(private)) == 2 and all("qwen3-tts-prebuild-inductor-" in d for d in private)
    assert not any(Path(d).exists() for d in private)
    assert "qwen3-tts-prebuild-inductor-" not in inductor["Aligner"]
    assert "warm-up request done" in out and "warm-up decode of lengths" in out
    assert "qwen3-tts-serve: prebuilt 3 replica start(s) of configs/local.yaml" in out
    # the environment each child got: the application's env_vars (local.yaml sets one thread)
    assert out.count("(OMP_NUM_THREADS=1)") == 3


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_replica_start_that_hangs_is_killed_with_its_children_and_a_killed_one_is_128_plus_its_signal(tmp_path):
    marker = tmp_path / "grandchild.pid"
    hang = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    # long enough for a loaded machine to start the child and its child before the timeout fires
    assert _run_child([sys.executable, "-c", hang], dict(os.environ), timeout_s=8.0) == 124
    assert time.monotonic() - t0 < 30
    grandchild = int(marker.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # killed with its group (gone, or a zombie its new parent has not reaped)
        if not _running(grandchild):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the hung start's own child outlived it")
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert _run_child([sys.executable, "-c", killed], dict(os.environ), timeout_s=30.0) == 128 + 9
    assert _run_child([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), timeout_s=30.0) == 3


def test_prebuild_takes_no_serve_run_arguments():
    proc = subprocess.run([sys.executable, "-m", "deployments.launcher.serve", "configs/local.yaml", "--prebuild",
                           "--address=local"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not used" in proc.stderr


def test_a_config_without_a_tts_application_is_refused():
    proc = subprocess.run([sys.executable, "-m", "deployments.launcher.prebuild", "/dev/null"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nothing to prebuild" in proc.stdout + proc.stderr
