"""What the `test_cluster_*.py` modules share: the paths of `cluster/` (and the configs, docs and metrics they
are checked against), the per-GPU resources `configs/split.yaml` asks for, and helpers that parse Serve configs
and run the start scripts (`--dry-run` output parsed with `ray start`'s own options).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

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


def load_yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def serve_app(config: dict) -> dict:
    (application,) = config["applications"]
    assert application["import_path"] == "deployments.builder:build_app"
    return application


def deployment_options(config: dict) -> dict[str, dict]:
    """name -> final Serve options of each deployment: the builder's merge, then the YAML's `deployments:`."""
    application = serve_app(config)
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
    for options in deployment_options(config).values():
        for name, amount in (options.get("ray_actor_options", {}).get("resources") or {}).items():
            out[name] = max(out.get(name, 0.0), float(amount))
    return out


SPLIT_RESOURCES = _requested_custom_resources(load_yaml(CONFIGS / "split.yaml"))


def run_script(argv: list[str], env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_OVERRIDE_RESOURCES", "CUDA_VISIBLE_DEVICES")}
    full_env.update(env or {})
    out = subprocess.run(["bash", *argv], capture_output=True, text=True, env=full_env, timeout=60)
    if check:
        assert out.returncode == 0, out.stderr
    return out


def ray_start_calls(stdout: str) -> list[dict]:
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

