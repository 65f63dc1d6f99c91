"""The files of `cluster/`: KubeRay RayService, cluster launcher YAML, start scripts, Grafana dashboard.

No cluster is started: the manifests are parsed and checked against the app's own config models, the
builder, Ray's schemas (Serve config, launcher schema, `ray start` options) and the metric names
`deployments/metrics.py` defines; the start scripts run in `--dry-run` or with a fake `ray`.
"""

from __future__ import annotations

import ast
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
import yaml

from deployments.builder import (
    code2wav_deployment_options,
    ingress_deployment_options,
    talker_deployment_options,
)
from deployments.config import TTSServingArgs

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
CONFIGS = ROOT / "configs"
RAYSERVICE = CLUSTER / "kuberay" / "rayservice.yaml"
MODEL_CACHE = CLUSTER / "kuberay" / "model-cache.yaml"
DOCKERFILE = CLUSTER / "kuberay" / "Dockerfile"
LAUNCHER = CLUSTER / "launcher" / "cluster.yaml"
START_HEAD = CLUSTER / "start_head.sh"
START_WORKERS = CLUSTER / "start_workers.sh"
DASHBOARD = CLUSTER / "grafana" / "qwen3_tts_dashboard.json"
METRICS_PY = ROOT / "deployments" / "metrics.py"
DOCS = ROOT / "docs" / "cluster.md"

GPU_RESOURCE = re.compile(r"^gpu_[0-9]+$")


def _yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _diff(a, b, path="") -> list[str]:
    """Paths where two parsed YAML documents differ (readable assertion messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}/{key}: only in {'first' if key in a else 'second'}")
            else:
                out += _diff(a[key], b[key], f"{path}/{key}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _app(config: dict) -> dict:
    (application,) = config["applications"]
    assert application["import_path"] == "deployments.builder:build_app"
    return application


def _deployment_options(config: dict) -> dict[str, dict]:
    """name -> final Serve options of each deployment: the builder's merge, then the YAML's `deployments:`."""
    application = _app(config)
    args = TTSServingArgs.model_validate(application["args"])
    options = {o["name"]: o for o in (
        *(talker_deployment_options(m) for m in args.models),
        code2wav_deployment_options(args.code2wav, args.stream_affinity),
        ingress_deployment_options(args),
    )}
    for override in application.get("deployments") or []:
        actor = override.get("ray_actor_options") or {}
        options[override["name"]].setdefault("ray_actor_options", {}).update(actor)
    return options


def _requested_custom_resources(config: dict) -> dict[str, float]:
    """Custom resources (other than CPU/GPU/memory) the deployments of a Serve config ask for."""
    out: dict[str, float] = {}
    for options in _deployment_options(config).values():
        for name, amount in (options.get("ray_actor_options", {}).get("resources") or {}).items():
            out[name] = max(out.get(name, 0.0), float(amount))
    return out


SPLIT_RESOURCES = _requested_custom_resources(_yaml(CONFIGS / "split.yaml"))


def test_split_config_asks_for_per_gpu_resources():
    # what the start scripts, the RayService and the launcher must provide
    assert SPLIT_RESOURCES, "configs/split.yaml asks for no custom resource"
    assert all(GPU_RESOURCE.match(name) and amount <= 1 for name, amount in SPLIT_RESOURCES.items()), SPLIT_RESOURCES


# ---------------------------------------------------------------------------------------------- KubeRay


def _rayservice() -> dict:
    return _yaml(RAYSERVICE)


def _containers(pod_template: dict) -> list[dict]:
    return pod_template["spec"]["containers"]


def _ray_start_resources(ray_start_params: dict) -> dict:
    """KubeRay passes `resources` to the shell as is: '"{\\"gpu_0\\": 1}"' -> {"gpu_0": 1}."""
    value = ray_start_params.get("resources")
    if value is None:
        return {}
    (unquoted,) = shlex.split(value)
    return json.loads(unquoted)


def test_rayservice_embeds_high_concurrency_config():
    from ray.serve.schema import ServeDeploySchema

    service = _rayservice()
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    from deployments.config import substitute_env

    # the RayService names its checkpoint (model-cache.yaml's Job downloads it): the file's `${VAR:-default}`s as
    # their defaults
    reference = substitute_env(_yaml(CONFIGS / "high_concurrency.yaml"), {})
    differences = _diff(embedded, reference)
    assert not differences, "serveConfigV2 differs from configs/high_concurrency.yaml:\n" + "\n".join(differences)
    ServeDeploySchema.model_validate(embedded)  # Serve's own schema (what KubeRay submits)
    TTSServingArgs.model_validate(_app(embedded)["args"])  # the builder's schema


def test_rayservice_gpu_pods_fit_the_embedded_application():
    service = _rayservice()
    options = _deployment_options(yaml.safe_load(service["spec"]["serveConfigV2"]))
    groups = service["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert groups
    # the embedded (co-located) config: one replica of each deployment fits in one GPU pod
    actor = [o.get("ray_actor_options", {}) for o in options.values()]
    gpus = sum(a.get("num_gpus", 0) for a in actor)
    cpus = sum(a.get("num_cpus", 1) for a in actor)
    for group in groups:
        (container,) = _containers(group["template"])
        limits = container["resources"]["limits"]
        assert str(limits["nvidia.com/gpu"]) == "1", "one GPU per worker pod"
        assert str(container["resources"].get("requests", limits).get("nvidia.com/gpu", "1")) == "1"
        assert group["rayStartParams"].get("num-gpus", "1") == "1"
        assert 0 < gpus <= 1
        assert cpus <= float(limits["cpu"]), f"{group['groupName']}: {cpus} CPUs of replicas, pod has {limits['cpu']}"


def test_rayservice_worker_groups_declare_the_split_resources():
    service = _rayservice()
    declared: dict[str, float] = {}
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        resources = _ray_start_resources(group["rayStartParams"])
        assert len(resources) == 1 and all(GPU_RESOURCE.match(k) and v == 1 for k, v in resources.items()), resources
        declared.update(resources)
    missing = set(SPLIT_RESOURCES) - set(declared)
    assert not missing, f"configs/split.yaml needs {sorted(missing)}; no worker group advertises them"
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert all("nvidia.com/gpu" not in c.get("resources", {}).get("limits", {}) for c in _containers(head["template"]))


def test_rayservice_readiness_uses_the_ready_route():
    from deployments.ingress import ENDPOINTS, TTSIngress

    ready = ENDPOINTS.get(("GET", "/ready"))
    assert ready is not None and callable(getattr(TTSIngress, ready, None)), "TTSIngress serves no GET /ready"
    service = _rayservice()
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = _containers(group["template"])
        probe = container["readinessProbe"]["httpGet"]
        assert probe["path"] == "/ready"
        http_port = yaml.safe_load(service["spec"]["serveConfigV2"])["http_options"]["port"]
        assert probe["port"] == http_port
        assert {"containerPort": http_port, "name": "serve"} in container["ports"]
    # never on the head: KubeRay waits for a ready head before it submits the application
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert all("readinessProbe" not in c for c in _containers(head["template"]))


def test_rayservice_checkpoint_comes_from_the_pvc_offline():
    service = _rayservice()
    cache_docs = list(yaml.safe_load_all(MODEL_CACHE.read_text(encoding="utf-8")))
    (pvc,) = [d for d in cache_docs if d["kind"] == "PersistentVolumeClaim"]
    (job,) = [d for d in cache_docs if d["kind"] == "Job"]
    claim = pvc["metadata"]["name"]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]  # every GPU pod mounts it
    embedded = yaml.safe_load(service["spec"]["serveConfigV2"])
    model_ids = {m["model"] for m in _app(embedded)["args"]["models"]}
    job_script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert all(m in job_script for m in model_ids), "the download Job fetches every model id"

    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    grace = max(o.get("graceful_shutdown_timeout_s", 0) for o in _deployment_options(embedded).values())
    for template in templates:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        (container,) = _containers(template)
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_OFFLINE"] == "1"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        (mount,) = [p for p in mounts if env["HF_HOME"].startswith(p.rstrip("/") + "/")]
        assert volumes[mounts[mount]]["persistentVolumeClaim"]["claimName"] == claim
        assert env["QWEN3_TTS_SERVE_HOME"].startswith(mount)  # uploaded voices shared by ingress replicas
    job_env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert job_env["HF_HOME"] == env["HF_HOME"]
    for group in cluster["workerGroupSpecs"]:  # streams drain before the pod is killed
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] > grace


def _dockerfile_ray_version() -> str:
    (base,) = re.findall(r"^FROM\s+rayproject/ray:([0-9.]+)-py311", DOCKERFILE.read_text(), flags=re.M)
    return base


def test_ray_versions_agree():
    service = _rayservice()
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _dockerfile_ray_version()
    images = {c["image"] for t in [cluster["headGroupSpec"]["template"]] + [g["template"] for g in
                                                                             cluster["workerGroupSpecs"]]
              for c in _containers(t)}
    assert len(images) == 1, f"head and workers must run one image: {images}"
    launcher = _yaml(LAUNCHER)
    assert launcher["docker"]["image"].startswith(f"rayproject/ray:{cluster['rayVersion']}-")
    assert any(f"ray[serve]=={cluster['rayVersion']}" in c for c in launcher["setup_commands"])


# ---------------------------------------------------------------------------------------------- launcher


def test_launcher_yaml_validates_with_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(_yaml(LAUNCHER))  # what `ray up` does: defaults, then the schema
    validate_config(config)


def test_launcher_node_types_are_one_gpu_each_with_the_split_resources():
    config = _yaml(LAUNCHER)
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["resources"].get("CPU") == 0
    declared = set()
    for name, node_type in types.items():
        if name == config["head_node_type"]:
            continue
        resources = node_type["resources"]
        assert resources["GPU"] == 1, f"{name}: one GPU per VM (the autoscaler sees one raylet per VM)"
        gpu_names = [k for k in resources if GPU_RESOURCE.match(k)]
        assert len(gpu_names) == 1 and resources[gpu_names[0]] == 1, resources
        declared.update(gpu_names)
    assert set(SPLIT_RESOURCES) <= declared


def _launcher_command(command: str) -> list[str]:
    """A launcher start command with this checkout in place of the synced copy."""
    config = _yaml(LAUNCHER)
    ((remote, local),) = config["file_mounts"].items()
    assert (ROOT / local).resolve() == ROOT
    argv = shlex.split(command.replace("$RAY_HEAD_IP", "10.1.2.3"))
    return [str(ROOT) + a[len(remote):] if a.startswith(remote + "/") else a for a in argv]


def test_launcher_start_commands_use_the_scripts_and_the_node_type_resources():
    config = _yaml(LAUNCHER)
    (head_cmd,) = config["head_start_ray_commands"]
    (worker_cmd,) = config["worker_start_ray_commands"]
    head_argv = _launcher_command(head_cmd)
    assert head_argv[:2] == ["bash", str(START_HEAD)]
    out = _run(head_argv[1:2] + ["--dry-run"] + head_argv[2:])
    (start,) = _ray_start_calls(out.stdout)
    assert "--head" in start["argv"] and any(a.startswith("--autoscaling-config=") for a in start["argv"])

    worker_argv = _launcher_command(worker_cmd)
    assert worker_argv[:2] == ["bash", str(START_WORKERS)]
    for name, node_type in config["available_node_types"].items():
        if name == config["head_node_type"]:
            continue
        # the launcher exports the node type's resources; the script turns them into one pinned raylet
        env = {"RAY_OVERRIDE_RESOURCES": json.dumps(node_type["resources"])}
        out = _run(worker_argv[1:2] + ["--dry-run", "--gpus", "0"] + worker_argv[2:], env=env)
        (start,) = _ray_start_calls(out.stdout)
        expected = {k: v for k, v in node_type["resources"].items() if GPU_RESOURCE.match(k)}
        assert start["resources"] == expected
        assert start["options"]["num_gpus"] == 1 and start["options"]["num_cpus"] == node_type["resources"]["CPU"]
        assert start["options"]["address"] == "10.1.2.3:6379"
        assert "RAY_OVERRIDE_RESOURCES" in start["unset"], "the node-wide override must not reach the raylet"


# ---------------------------------------------------------------------------------------------- scripts


def _run(argv: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_OVERRIDE_RESOURCES", "CUDA_VISIBLE_DEVICES")}
    full_env.update(env or {})
    out = subprocess.run(["bash", *argv], capture_output=True, text=True, env=full_env, timeout=60)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def _ray_start_calls(stdout: str) -> list[dict]:
    """The `ray start` commands a script printed in --dry-run, parsed with Ray's own CLI options."""
    from ray.scripts.scripts import start

    calls = []
    for line in stdout.splitlines():
        if not line.startswith("+ "):
            continue
        argv = shlex.split(line[2:])
        env, unset = {}, []
        if argv[0] == "env":
            argv = argv[1:]
            while argv and (argv[0] == "-u" or "=" in argv[0]):
                if argv[0] == "-u":
                    unset.append(argv[1])
                    argv = argv[2:]
                else:
                    key, _, value = argv.pop(0).partition("=")
                    env[key] = value
        if argv[1:2] != ["start"]:
            continue
        ctx = start.make_context("start", list(argv[2:]))  # unknown options / bad types raise here
        calls.append({"argv": argv[2:], "env": env, "unset": unset, "options": ctx.params,
                      "resources": json.loads(ctx.params["resources"])})
    return calls


@pytest.mark.parametrize("script", [START_HEAD, START_WORKERS])
def test_scripts_parse_and_have_usage(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    subprocess.run(["bash", "-n", str(script)], check=True)
    out = _run([str(script), "--help"])
    assert out.stdout.startswith("Usage:")
    bad = _run([str(script), "--no-such-flag"], check=False)
    assert bad.returncode == 2 and "Usage:" in bad.stderr


def test_start_workers_pins_one_raylet_per_gpu_with_the_split_resources():
    out = _run([str(START_WORKERS), "--address", "10.0.0.1:6379", "--gpus", "0,1", "--dry-run"])
    calls = _ray_start_calls(out.stdout)
    assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in calls] == ["0", "1"]
    assert [c["resources"] for c in calls] == [{"gpu_0": 1}, {"gpu_1": 1}]
    # the default names are exactly what configs/split.yaml asks for
    assert set(SPLIT_RESOURCES) == {name for c in calls for name in c["resources"]}
    for c in calls:
        assert c["options"]["num_gpus"] == 1 and c["options"]["address"] == "10.0.0.1:6379"
    # raylets sharing a host need their own ports
    ranges = [(c["options"]["min_worker_port"], c["options"]["max_worker_port"]) for c in calls]
    head = _ray_start_calls(_run([str(START_HEAD), "--dry-run", "--restart"]).stdout)[0]["options"]
    ranges.append((head["min_worker_port"], head["max_worker_port"]))
    ranges.sort()
    assert all(hi < next_lo for (_, hi), (next_lo, _) in zip(ranges, ranges[1:], strict=False)), ranges
    agent_ports = [c["options"]["dashboard_agent_listen_port"] for c in calls] + [52365]
    metrics_ports = [c["options"]["metrics_export_port"] for c in calls] + [head["metrics_export_port"]]
    assert len(set(agent_ports)) == len(agent_ports) and len(set(metrics_ports)) == len(metrics_ports)


def test_start_workers_names_and_errors():
    out = _run([str(START_WORKERS), "--address", "h:6379", "--gpus", "0,1,2,3", "--names",
                "gpu_0,gpu_0,gpu_1,gpu_1", "--dry-run"])
    assert [c["resources"] for c in _ray_start_calls(out.stdout)] == [{"gpu_0": 1}, {"gpu_0": 1},
                                                                      {"gpu_1": 1}, {"gpu_1": 1}]
    no_address = _run([str(START_WORKERS), "--gpus", "0"], check=False)
    assert no_address.returncode == 2 and "--address" in no_address.stderr
    mismatch = _run([str(START_WORKERS), "--address", "h:6379", "--gpus", "0,1", "--names", "gpu_0", "--dry-run"],
                    check=False)
    assert mismatch.returncode == 2 and "names" in mismatch.stderr


def test_start_head_is_gpu_less_by_default():
    (call,) = _ray_start_calls(_run([str(START_HEAD), "--dry-run", "--restart"]).stdout)
    assert "--head" in call["argv"] and call["options"]["num_gpus"] == 0
    assert call["env"]["CUDA_VISIBLE_DEVICES"] == ""  # CPU replicas on the head see no GPU
    assert call["resources"] == {}
    (pinned,) = _ray_start_calls(_run([str(START_HEAD), "--dry-run", "--restart", "--gpu", "1"]).stdout)
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
        out = _run([str(START_WORKERS), "--address", "10.9.9.9:59997", "--gpus", "0,1", "--dry-run"])
        assert [c["env"]["CUDA_VISIBLE_DEVICES"] for c in _ray_start_calls(out.stdout)] == ["0"]
        assert "GPU 1 already has a raylet" in out.stdout
        other_cluster = _run([str(START_WORKERS), "--address", "10.9.9.9:59996", "--gpus", "0,1", "--dry-run"])
        assert len(_ray_start_calls(other_cluster.stdout)) == 2
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
    _run([str(START_WORKERS), "--address", "10.9.9.9:59999", "--gpus", "0,1"], env=env)
    _run([str(START_WORKERS), "--stop"], env=env)
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

    dry = _run([str(START_HEAD), "--dry-run", "--restart", "--gpu", "0", "--mps"],
               env={**env, "CUDA_VISIBLE_DEVICES": "3"}).stdout.splitlines()
    commands = [shlex.split(line[2:]) for line in dry if line.startswith("+ ")]
    # the daemon sees every GPU of the host (no CUDA_VISIBLE_DEVICES of the caller), then Ray starts
    assert commands[-2] == ["env", "-u", "CUDA_VISIBLE_DEVICES", str(fake_mps), "-d"]
    assert commands[-1][:2] == ["env", "CUDA_VISIBLE_DEVICES=0"] and commands[-1][3] == "start"
    _run([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0,1", "--mps"],
         env={**env, "CUDA_VISIBLE_DEVICES": "0,1"})
    started = calls()
    assert [c.get("mps") or c["argv"][0] for c in started] == [["-d"], "start", "start"]
    assert started[0]["cvd"] is None and [c["cvd"] for c in started[1:]] == ["0", "1"]
    _run([str(START_WORKERS), "--stop", "--mps"], env=env)  # no daemon runs: only `ray stop`
    assert [c.get("mps") or c["argv"] for c in calls()] == [["stop"]]

    # a running daemon: started again by no one, quit by --stop --mps (after `ray stop`)
    daemon = subprocess.Popen([fake_mps.name, "-d"], executable=sys.executable, stdin=subprocess.PIPE)
    try:
        out = _run([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0", "--mps"], env=env).stdout
        assert "already runs" in out
        assert [c.get("mps") or c["argv"][0] for c in calls()] == ["start"]
        _run([str(START_HEAD), "--stop", "--mps"], env=env)
        assert calls() == [{"argv": ["stop"], "cvd": None, "override": None, "serve_env": ["1", "1"]},
                           {"mps": [], "stdin": "quit\n", "cvd": None}]
    finally:
        daemon.kill()
        daemon.wait()

    missing = _run([str(START_HEAD), "--restart", "--mps"], env={**env, "MPS_CONTROL": str(tmp_path / "absent")},
                   check=False)
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_gpu_raylets_get_mps_and_the_fast_serve_settings_by_default(tmp_path):
    """Without flags a GPU raylet starts after an MPS control daemon (when its binary exists) and every `ray start`
    sees the fastest measured Serve settings; --no-mps and an explicit =0 opt out; a head without a GPU needs no
    daemon."""
    env, calls = _fake_ray_and_mps(tmp_path, "fake-mps-control-auto")

    _run([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0"], env=env)
    started = calls()
    assert [c.get("mps") or c["argv"][0] for c in started] == [["-d"], "start"]
    assert started[1]["serve_env"] == ["1", "1"]
    _run([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0", "--no-mps"],
         env={**env, "RAY_SERVE_ENABLE_HA_PROXY": "0"})
    started = calls()
    assert [c.get("mps") or c["argv"][0] for c in started] == ["start"]
    assert started[0]["serve_env"] == ["1", "0"]
    out = _run([str(START_HEAD), "--restart"], env=env).stdout  # no --gpu: no daemon
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1" in out
    assert all("mps" not in c for c in calls())
    absent = _run([str(START_WORKERS), "--address", "10.9.9.9:59998", "--gpus", "0"],
                  env={**env, "MPS_CONTROL": str(tmp_path / "absent")})
    assert "without MPS" in absent.stdout and [c["argv"][0] for c in calls()] == ["start"]


# ---------------------------------------------------------------------------------------------- Grafana


def _defined_metrics() -> dict[str, str]:
    """name -> Counter | Gauge | Histogram, read from deployments/metrics.py (not hard-coded here)."""
    out = {}
    for node in ast.walk(ast.parse(METRICS_PY.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("Counter", "Gauge", "Histogram")):
            name = node.args[0] if node.args else next(k.value for k in node.keywords if k.arg == "name")
            assert isinstance(name, ast.Constant) and isinstance(name.value, str)
            out[name.value] = node.func.attr
    assert out, "no metric found in deployments/metrics.py"
    return out


def _prometheus_names(name: str, kind: str) -> set[str]:
    """What Ray's Prometheus endpoint exports for a metric: `ray_` prefix, `_total` on counters."""
    base = f"ray_{name}"
    return {"Counter": {f"{base}_total"}, "Gauge": {base},
            "Histogram": {f"{base}_bucket", f"{base}_sum", f"{base}_count"}}[kind]


def _ray_builtin_metrics() -> dict[str, str]:
    """Serve's and the node reporter's metrics in the installed Ray (f-string protocol names expanded)."""
    import ray

    pkg = Path(ray.__file__).parent
    sources = [*sorted((pkg / "serve").rglob("*.py")), pkg / "dashboard" / "modules" / "reporter" / "reporter_agent.py"]
    pattern = re.compile(r"\b(Counter|Gauge|Histogram)\(\s*(?:name=)?f?\"((?:serve|node)_[a-z_{}]+)\"")
    out = {}
    for source in sources:
        for kind, name in pattern.findall(source.read_text(encoding="utf-8", errors="replace")):
            for protocol in ("http", "grpc"):
                out[re.sub(r"\{[a-z_]+\}", protocol, name)] = kind
    return out


def _dashboard_queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return queries


def test_dashboard_is_valid_and_uses_a_prometheus_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for target in p["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
            assert target["expr"].count("{") == target["expr"].count("}"), target["expr"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24


def test_dashboard_queries_every_app_metric_by_its_exported_name():
    dashboard = json.loads(DASHBOARD.read_text())
    tokens = {t for q in _dashboard_queries(dashboard) for t in re.findall(r"\bray_[A-Za-z0-9_]+", q)}
    defined = _defined_metrics()
    valid = set().union(*(_prometheus_names(n, k) for n, k in defined.items()))
    for name, kind in defined.items():
        wanted = f"ray_{name}_bucket" if kind == "Histogram" else next(iter(_prometheus_names(name, kind)))
        assert wanted in tokens, f"{kind} {name} ({wanted}) is in no panel query"
    builtin = _ray_builtin_metrics()
    builtin_valid = set().union(*(_prometheus_names(n, k) for n, k in builtin.items()))
    for token in tokens:
        if token.startswith(("ray_serve_", "ray_node_")):
            assert token in builtin_valid, f"{token}: not a metric the installed Ray exports"
        else:
            assert token in valid, f"{token}: not exported by deployments/metrics.py (wrong suffix or stale)"
    assert {"ray_serve_deployment_queued_queries", "ray_serve_deployment_replica_healthy",
            "ray_serve_num_ongoing_requests_at_replicas"} <= tokens  # Serve's replica / queue view


# ---------------------------------------------------------------------------------------------- docs


def test_docs_commands_match_the_files():
    text = DOCS.read_text()
    blocks = "\n".join(re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S))
    for path in set(re.findall(r"\b((?:cluster|configs)/[A-Za-z0-9_./-]+\.(?:sh|yaml|json))\b", text)):
        assert (ROOT / path).exists(), f"docs/cluster.md names {path}, which does not exist"
    for script in (START_HEAD, START_WORKERS):
        usage = _run([str(script), "--help"]).stdout
        rel = script.relative_to(ROOT).as_posix()
        lines = [line for line in blocks.splitlines() if rel in line]
        assert lines, f"docs/cluster.md never runs {rel}"
        for line in lines:
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line.split(rel, 1)[1].split(" -- ")[0]):
                assert flag in usage, f"docs/cluster.md: {rel} has no {flag}"


def _histogram_boundaries() -> dict[str, list[float]]:
    """Exported bucket name -> the `le` bounds Ray exports for it (deployments/metrics.py's boundaries, +Inf)."""
    from unittest import mock

    from ray.serve import metrics as serve_metrics

    import deployments.metrics as app_metrics

    made: dict[str, list[float]] = {}

    def histogram(name, description="", boundaries=None, tag_keys=None):
        made[f"ray_{name}_bucket"] = [float(b) for b in boundaries]
        return mock.MagicMock()

    with mock.patch.object(serve_metrics, "Histogram", histogram), \
            mock.patch.object(serve_metrics, "Counter", mock.MagicMock()), \
            mock.patch.object(serve_metrics, "Gauge", mock.MagicMock()):
        app_metrics.IngressMetrics(), app_metrics.TalkerMetrics("m"), app_metrics.Code2WavMetrics()
    return made


def test_dashboard_bucket_selectors_name_buckets_ray_exports():
    """A `le="x"` selector names a series only when x is a boundary of that histogram ("Streams that ran dry"
    once selected le="0.0", a series no histogram had)."""
    boundaries = _histogram_boundaries()
    selectors = [(m, le) for q in _dashboard_queries(json.loads(DASHBOARD.read_text()))
                 for m, le in re.findall(r"\b(ray_[a-z0-9_]+_bucket)\{[^}]*\ble=\"([^\"]+)\"", q)]
    for metric, le in selectors:
        assert le == "+Inf" or float(le) in boundaries[metric], f'{metric}{{le="{le}"}} is not a series Ray exports'


def test_first_audio_buckets_resolve_the_served_range():
    boundaries = _histogram_boundaries()["ray_tts_time_to_first_audio_ms_bucket"]
    assert {5.0, 10.0, 15.0, 20.0, 30.0} <= set(boundaries) and boundaries == sorted(boundaries)


def test_dashboard_means_are_labelled_approximate():
    """Ray rebuilds a histogram's `_sum` from bucket midpoints: a mean from it is approximate, and says so."""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for target in p.get("targets", []):
            if "_sum{" in target["expr"]:
                assert "approx" in target["legendFormat"] or "approximate" in p["title"], (p["title"], target)


PRESTOP = CLUSTER / "kuberay" / "prestop_drain.sh"


def test_prestop_drains_the_node_and_waits_for_its_replicas_before_stopping_ray(tmp_path):
    """The GPU pods' preStop: `ray drain-node` first, `ray stop` only once no Serve replica is left (a stand-in
    `pgrep` reports replicas for its first three calls), within a budget below the pod's grace period."""
    service = _rayservice()
    for group in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        spec = group["template"]["spec"]
        (container,) = _containers(group["template"])
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["/bin/bash", "/home/ray/qwen3-tts-serve/cluster/kuberay/prestop_drain.sh"]
        assert 0 < int(command[2]) < spec["terminationGracePeriodSeconds"]
    log, count = tmp_path / "calls.log", tmp_path / "pgrep.count"
    (tmp_path / "ray").write_text(f'#!/bin/sh\necho "ray $*" >> "{log}"\n')
    (tmp_path / "pgrep").write_text(  # replicas left for three polls, then none
        f'#!/bin/sh\nn=$(cat "{count}" 2>/dev/null || echo 0); echo $((n + 1)) > "{count}"\n'
        f'echo "pgrep" >> "{log}"\n[ "$n" -lt 3 ] && {{ echo 1; exit 0; }}; echo 0; exit 1\n')
    for tool in ("ray", "pgrep"):
        (tmp_path / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "QWEN3_TTS_DRAIN_POLL_S": "0"}
    subprocess.run(["bash", str(PRESTOP), "60"], env=env, check=True, capture_output=True, timeout=60)
    calls = log.read_text().splitlines()
    assert calls[0].startswith("ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION")
    assert "--deadline-remaining-seconds 60" in calls[0]
    assert calls[1:5] == ["pgrep"] * 4 and calls[-1] == "ray stop"


def test_podmonitor_scrapes_the_rayservices_pods_on_their_metrics_port():
    monitor = _yaml(CLUSTER / "kuberay" / "podmonitor.yaml")
    service = _rayservice()
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    labels = monitor["spec"]["selector"]["matchLabels"]
    assert labels == {"ray.io/is-ray-node": "yes", "ray.io/originated-from-cr-name": service["metadata"]["name"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for template in templates:
        (container,) = _containers(template)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[endpoint["port"]] == int(cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"])
