"""The start scripts `cluster/start_head.sh` and `cluster/start_workers.sh`, and the commands docs/cluster.md runs
with them.

No cluster is started: the scripts run in `--dry-run` (their `ray start` commands parsed with Ray's own CLI
options) or with a fake `ray` and a fake MPS control binary that log their calls.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deployments.cluster_files import (
    DOCS,
    ROOT,
    SPLIT_RESOURCES,
    START_HEAD,
    START_WORKERS,
    ray_start_calls,
    run_script,
)


@pytest.mark.parametrize("script", [START_HEAD, START_WORKERS])
def test_scripts_parse_and_have_usage(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = run_script([str(script), "--help"])
    assert out.stdout.startswith("Usage:")
    bad = run_script([str(script), "--no-such-flag"], check=False)
    assert bad.returncode == 2 and "Usage:" in bad.stderr


def test_start_workers_pins_one_raylet_per_gpu_with_the_split_resources():
    out = run_script([str(START_WORKERS), "--address", "10.0.0.1:6379", "--gpus", "0,1", "--dry-run"])
    calls = ray_start_calls(out.stdout)
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in calls] == ["0", "1"]
    assert [c["resources"] for c in calls] == [{"gpu_0": 1}, {"gpu_1": 1}]
    # the default names are exactly what configs/split.yaml asks for
    assert set(SPLIT_RESOURCES) == {name for c in calls for name in c["resources"]}
    for c in calls:
        assert c["options"]["num_gpus"] == 1 and c["options"]["address"] == "10.0.0.1:6379"
    # raylets sharing a host need their own ports
    ranges = [(c["options"]["min_worker_port"], c["options"]["max_worker_port"]) for c in calls]
    head = ray_start_calls(run_script([str(START_HEAD), "--dry-run", "--restart"]).stdout)[0]["options"]
    ranges.append((head["min_worker_port"], head["max_worker_port"]))
    ranges.sort()
    assert all(hi < next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:], strict=False)), ranges
    agent_ports = [c["options"]["dashboard_agent_listen_port"] for c in calls] + [52365]
    metrics_ports = [c["options"]["metrics_export_port"] for c in calls] + [head["metrics_export_port"]]
    assert len(set(agent_ports)) == len(agent_ports) and len(set(metrics_ports)) == len(metrics_ports)


def test_start_workers_names_and_errors():
    out = run_script([str(START_WORKERS), "--address", "h:6379", "--gpus", "0,1,2,3", "--names",
                      "gpu_0,gpu_0,gpu_1,gpu_1", "--dry-run"])
    assert [c["resources"] for c in ray_start_calls(out.stdout)] == [{"gpu_0": 1}, {"gpu_0": 1},
                                                                     {"gpu_1": 1}, {"gpu_1": 1}]
    no_address = run_script([str(START_WORKERS), "--gpus", "0"], check=False)
    assert no_address.returncode == 2 and "--address" in no_address.stderr
    mismatch = run_script([str(START_WORKERS), "--address", "h:6379", "--gpus", "0,1", "--names", "gpu_0", "--dry-run"],
                          check=False)
    assert mismatch.returncode == 2 and "names" in mismatch.stderr


def test_start_head_is_gpu_less_by_default():
    (call,) = ray_start_calls(run_script([str(START_HEAD), "--dry-run", "--restart"]).stdout)
    assert "--head" in call["argv"] and call["options"]["num_gpus"] == 0
    assert call["env"]["CUDA_VISIBLE_DEVICES"] == ""  # CPU replicas on the head see no GPU
    assert call["resources"] == {}
    (pinned,) = ray_start_calls(run_script([str(START_HEAD), "--dry-run", "--restart", "--gpu", "1"]).stdout)
    assert pinned["env"]["CUDA_VISIBLE_DEVICES"] == "1" and pinned["resources"] == {"gpu_1": 1}


@pytest.mark.skipif(not Path("/proc/self/comm").exists(), reason="needs /proc")
def test_start_workers_skips_gpus_that_already_have_a_raylet(tmp_path):
    # a process named `raylet` of the cluster on port 59997, started for GPU 1
    fake = tmp_path / "raylet"
    shutil.copy(shutil.which("bash"), fake)  # a copy, not a link: the kernel names the process after the file
    proc = subprocess.Popen([str(fake), "-c", "sleep 60; :", "--gcs-address=10.9.9.9:59997"],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "1"})
    try:
        comm = Path(f"/proc/{proc.pid}/comm")
        for _ in range(100):  # the name is set late in exec
            if comm.read_text().strip() == "raylet":
                break
            time.sleep(0.05)
        assert comm.read_text().strip() == "raylet"
        out = run_script([str(START_WORKERS), "--address", "10.9.9.9:59997", "--gpus", "0,1", "--dry-run"])
        assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in ray_start_calls(out.stdout)] == ["0"]
        assert "GPU 1 already has a raylet" in out.stdout
        other_cluster = run_script([str(START_WORKERS), "--address", "10.9.9.9:59996", "--gpus", "0,1", "--dry-run"])
        assert len(ray_start_calls(other_cluster.stdout)) == 2
    finally:
        proc.kill()
        proc.wait()


FAKE_RAY = """#!{python}
import json, os, sys
with open(os.environ["FAKE_RAY_LOG"], "a") as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "override": os.environ.get("RAY_OVERRIDE_RESOURCES"),
                        "serve_env": [os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED"),
                                      os.environ.get("RAY_SERVE_ENABLE_HA_PROXY")]}}) + "\\n")
"""


def test_scripts_really_run_ray_with_the_environment(tmp_path):
    fake = tmp_path / "ray"
    fake.write_text(FAKE_RAY.format(python=sys.executable))
    fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {"RAY": str(fake), "FAKE_RAY_LOG": str(log), "RAY_OVERRIDE_RESOURCES": '{"CPU": 16, "GPU": 2}'}
    # a port no test cluster uses: nothing running is mistaken for this cluster's raylets
    run_script([str(START_WORKERS), "--address", "10.9.9.9:59999", "--gpus", "0,1"], env=env)
    run_script([str(START_WORKERS), "--stop"], env=env)
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c["cvd"] for c in calls[:2]] == ["0", "1"]
    assert all(c["override"] is None and c["argv"][0] == "start" for c in calls[:2])
    assert "--num-cpus=8" in calls[0]["argv"]  # the node's CPUs from the override, split between the raylets
    assert calls[2]["argv"] == ["stop"]


FAKE_MPS = """#!{python}
import json, os, sys
with open(os.environ["FAKE_RAY_LOG"], "a") as f:
    f.write(json.dumps({{"mps": sys.argv[1:], "stdin": "" if sys.argv[1:] == ["-d"] else sys.stdin.read(),
                        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
"""


def _fake_ray_and_mps(tmp_path: Path, mps_name: str):
    """Stand-ins for `ray` and the MPS control binary that log their calls: -> (the scripts' env, calls())."""
    fake_ray, fake_mps = tmp_path / "ray", tmp_path / mps_name
    fake_ray.write_text(FAKE_RAY.format(python=sys.executable))
    fake_mps.write_text(FAKE_MPS.format(python=sys.executable))
    for fake in (fake_ray, fake_mps):
        fake.chmod(0o755)
    log = tmp_path / "calls.jsonl"

    def calls() -> list[dict]:
        """The calls logged since the last read."""
        out = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        return out

    return {"RAY": str(fake_ray), "MPS_CONTROL": str(fake_mps), "FAKE_RAY_LOG": str(log)}, calls


def test_mps_daemon_starts_before_ray_once_and_quits_with_stop(tmp_path):
    """--mps: the MPS control daemon is started before the first `ray start` (processes started before it are
    not its clients), not again while one runs, and `--stop --mps` quits it after `ray stop`. A process whose
    command line is `<control name> -d` stands for a running daemon (the real one never runs in CI: the
    fake has a name of its own)."""
    env, calls = _fake_ray_and_mps(tmp_path, "fake-mps-control-test")
    fake_mps = Path(env["MPS_CONTROL"])

    dry = run_script([str(START_HEAD), "--dry-run", "--restart", "--gpu", "0", "--mps"],
                     env={**env, "CUDA_VISIBLE_DEVICES": "3"}).stdout.splitlines()
    commands = [shlex.split(line[2:]) for line in dry if line.startswith("+ ")]
    # the daemon sees every GPU of the host (no CUDA_VISIBLE_DEVICES of the caller), then Ray starts
    assert commands[-2] == ["env", "-u", "CUDA_VISIBLE_DEVICES", str(fake_mps), "-d"]
    assert commands[-1][:2] == ["env", "CUDA_VISIBLE_DEVICES=0"] and commands[-1][3] == "start"
    run_script([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0,1", "--mps"],
               env={**env, "CUDA_VISIBLE_DEVICES": "0,1"})
    started = calls()
    assert [c.get("mps") or c["argv"][0] for c in started] == [["-d"], "start", "start"]
    assert started[0]["cvd"] is None and [c["cvd"] for c in started[1:]] == ["0", "1"]
    run_script([str(START_WORKERS), "--stop", "--mps"], env=env)  # no daemon runs: only `ray stop`
    assert [c.get("mps") or c["argv"] for c in calls()] == [["stop"]]

    # a running daemon: started again by no one, quit by --stop --mps (after `ray stop`)
    daemon = subprocess.Popen([fake_mps.name, "-d"], executable=sys.executable, stdin=subprocess.PIPE)
    try:
        out = run_script([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0", "--mps"], env=env).stdout
        assert "already runs" in out
        assert [c.get("mps") or c["argv"][0] for c in calls()] == ["start"]
        run_script([str(START_HEAD), "--stop", "--mps"], env=env)
        assert calls() == [{"argv": ["stop"], "cvd": None, "override": None, "serve_env": ["1", "1"]},
                           {"mps": [], "stdin": "quit\n", "cvd": None}]
    finally:
        daemon.kill()
        daemon.wait()

    missing = run_script([str(START_HEAD), "--restart", "--mps"], env={**env, "MPS_CONTROL": str(tmp_path / "absent")},
                         check=False)
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_gpu_raylets_get_mps_and_the_fast_serve_settings_by_default(tmp_path):
    """Without flags a GPU raylet starts after an MPS control daemon (when its binary exists) and every `ray start`
    sees the fastest measured Serve settings; --no-mps and an explicit =0 opt out; a head without a GPU needs no
    daemon."""
    env, calls = _fake_ray_and_mps(tmp_path, "fake-mps-control-auto")

    run_script([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0"], env=env)
    started = calls()
    assert [c.get("mps") or c["argv"][0] for c in started] == [["-d"], "start"]
    assert started[1]["serve_env"] == ["1", "1"]
    run_script([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0", "--no-mps"],
               env={**env, "RAY_SERVE_ENABLE_HA_PROXY": "0"})
    started = calls()
    assert [c.get("mps") or c["argv"][0] for c in started] == ["start"]
    assert started[0]["serve_env"] == ["1", "0"]
    out = run_script([str(START_HEAD), "--restart"], env=env).stdout  # no --gpu: no daemon
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1" in out
    assert all("mps" not in c for c in calls())
    absent = run_script([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0"],
                        env={**env, "MPS_CONTROL": str(tmp_path / "absent")})
    assert "without MPS" in absent.stdout and [c["argv"][0] for c in calls()] == ["start"]


# ---------------------------------------------------------------------------------------------- docs


def test_docs_commands_match_the_files():
    text = DOCS.read_text()
    blocks = "\n".join(re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S))
    for path in set(re.findall(r"\b((?:cluster|configs)/[A-Za-z0-9_./-]+\.(?:sh|yaml|json))\b", text)):
        assert (ROOT / path).exists(), f"docs/cluster.md names {path}, which does not exist"
    for script in (START_HEAD, START_WORKERS):
        usage = run_script([str(script), "--help"]).stdout
        rel = script.relative_to(ROOT).as_posix()
        lines = [line for line in blocks.splitlines() if rel in line]
        assert lines, f"docs/cluster.md never runs {rel}"
        for line in lines:
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split(rel, 1)[1].split(" -- ")[0]):
                assert flag in usage, f"docs/cluster.md: {rel} has no {flag}"
