"""The KubeRay files of `cluster/kuberay/`: the RayService, the model cache, the image, the preStop hook and the
PodMonitor, and the per-GPU resources `configs/split.yaml` asks for (which they and the launcher provide).

No cluster is started: the manifests are parsed and checked against the app's own config models, the
builder and Serve's schema (what KubeRay submits).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess

import yaml

from deployments.config import TTSServingArgs
from tests.deployments.cluster_files import (
    CLUSTER,
    CONFIGS,
    DOCKERFILE,
    GPU_RESOURCE,
    LAUNCHER,
    MODEL_CACHE,
    RAYSERVICE,
    SPLIT_RESOURCES,
    deployment_options,
    load_yaml,
    serve_app,
)


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


def test_split_config_asks_for_per_gpu_resources():
    # what the start scripts, the RayService and the launcher must provide
    assert SPLIT_RESOURCES, "configs/split.yaml asks for no custom resource"
    assert all(GPU_RESOURCE.match(name) and amount <= 1 for name, amount in SPLIT_RESOURCES.items()), SPLIT_RESOURCES


# ---------------------------------------------------------------------------------------------- KubeRay


def _rayservice() -> dict:
    return load_yaml(RAYSERVICE)


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
    reference = substitute_env(load_yaml(CONFIGS / "high_concurrency.yaml"), {})
    differences = _diff(embedded, reference)
    assert not differences, "serveConfigV2 differs from configs/high_concurrency.yaml:\n" + "\n".join(differences)
    ServeDeploySchema.model_validate(embedded)  # Serve's own schema (what KubeRay submits)
    TTSServingArgs.model_validate(serve_app(embedded)["args"])  # the builder's schema


def test_rayservice_gpu_pods_fit_the_embedded_application():
    service = _rayservice()
    options = deployment_options(yaml.safe_load(service["spec"]["serveConfigV2"]))
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
    model_ids = {m["model"] for m in serve_app(embedded)["args"]["models"]}
    job_script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert all(m in job_script for m in model_ids), "the download Job fetches every model id"

    cluster = service["spec"]["rayClusterConfig"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    grace = max(o.get("graceful_shutdown_timeout_s", 0) for o in deployment_options(embedded).values())
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
    launcher = load_yaml(LAUNCHER)
    assert launcher["docker"]["image"].startswith(f"rayproject/ray:{cluster['rayVersion']}-")
    assert any(f"ray[serve]=={cluster['rayVersion']}" in c for c in launcher["setup_commands"])


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
    monitor = load_yaml(CLUSTER / "kuberay" / "podmonitor.yaml")
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
