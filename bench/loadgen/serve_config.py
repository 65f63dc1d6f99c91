"""Write a copy of a Serve config for a benchmark run: every model at a local checkpoint, offline, plus
optional `--set path=value` overrides (dotted path under the first application's `args`; YAML values).

    python -m bench.loadgen.serve_config configs/high_concurrency.yaml /tmp/cfg.yaml \\
        --checkpoint /tmp/ckpt/1.7b-custom_voice --set models.0.engine_kwargs.max_num_seqs=128
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml


def set_path(tree: Any, dotted: str, value: Any) -> None:
    """`a.0.b=value`: dict keys and list indices; missing dict keys are created."""
    *parents, last = dotted.split(".")
    node = tree
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def bench_config(base: dict[str, Any], checkpoint: str | None, port: int | None = None,
                 overrides: list[str] = ()) -> dict[str, Any]:
    config = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    app = config["applications"][0]
    args = app["args"]
    if checkpoint:
        for model in args["models"]:
            model["model"] = checkpoint
    env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
    env["HF_HUB_OFFLINE"] = "1"
    # random weights stop at random: the load generator asks for fixed lengths (`suppress_eos`), which
    # production configs refuse (`allow_suppress_eos` is off by default)
    args.setdefault("ingress", {})["allow_suppress_eos"] = True
    if port is not None:
        config.setdefault("http_options", {})["port"] = port
    for item in overrides:
        path, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects path=value, got {item!r}")
        set_path(args, path.strip(), yaml.safe_load(raw))
    return config


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--checkpoint", default=None, help="checkpoint directory for every model")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE")
    args = ap.parse_args(argv)
    config = bench_config(yaml.safe_load(args.base.read_text()), args.checkpoint, args.port, args.overrides)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))
    print(args.out)


if __name__ == "__main__":
    main()
