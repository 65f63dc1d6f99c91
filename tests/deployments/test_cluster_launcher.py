"""The cluster launcher YAML `cluster/launcher/cluster.yaml`: Ray's launcher schema, one-GPU node types with the
resources `configs/split.yaml` asks for, and start commands that call the start scripts (run in `--dry-run`,
their `ray start` commands parsed with Ray's own CLI options).
"""

from __future__ import annotations

import json
import shlex

from tests.deployments.cluster_files import (
    GPU_RESOURCE,
    LAUNCHER,
    ROOT,
    SPLIT_RESOURCES,
    START_HEAD,
    START_WORKERS,
    load_yaml,
    ray_start_calls,
    run_script,
)


def test_launcher_yaml_validates_with_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(load_yaml(LAUNCHER))  # what `ray up` does: defaults, then the schema
    validate_config(config)


def test_launcher_node_types_are_one_gpu_each_with_the_split_resources():
    config = load_yaml(LAUNCHER)
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
    config = load_yaml(LAUNCHER)
    ((remote, local),) = config["file_mounts"].items()
    assert (ROOT / local).resolve() == ROOT
    argv = shlex.split(command.replace("$RAY_HEAD_IP", "10.1.2.3"))
    return [str(ROOT) + a[len(remote):] if a.startswith(remote + "/") else a for a in argv]


def test_launcher_start_commands_use_the_scripts_and_the_node_type_resources():
    config = load_yaml(LAUNCHER)
    (head_cmd,) = config["head_start_ray_commands"]
    (worker_cmd,) = config["worker_start_ray_commands"]
    head_argv = _launcher_command(head_cmd)
    assert head_argv[:2] == ["bash", str(START_HEAD)]
    out = run_script(head_argv[1:2] + ["--dry-run"] + head_argv[2:])
    (start,) = ray_start_calls(out.stdout)
    assert "--head" in start["argv"] and any(a.startswith("--autoscaling-config=") for a in start["argv"])

    worker_argv = _launcher_command(worker_cmd)
    assert worker_argv[:2] == ["bash", str(START_WORKERS)]
    for name, node_type in config["available_node_types"].items():
        if name == config["head_node_type"]:
            continue
        # the launcher exports the node type's resources; the script turns them into one pinned raylet
        env = {"RAY_OVERRIDE_RESOURCES": json.dumps(node_type["resources"])}
        out = run_script(worker_argv[1:2] + ["--dry-run", "--gpus", "0"] + worker_argv[2:], env=env)
        (start,) = ray_start_calls(out.stdout)
        expected = {k: v for k, v in node_type["resources"].items() if GPU_RESOURCE.match(k)}
        assert start["resources"] == expected
        assert start["options"]["num_gpus"] == 1 and start["options"]["num_cpus"] == node_type["resources"]["CPU"]
        assert start["options"]["address"] == "10.1.2.3:6379"
        assert "RAY_OVERRIDE_RESOURCES" in start["unset"], "the node-wide override must not reach the raylet"
