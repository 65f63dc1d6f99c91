"""`qwen3-tts-serve --prebuild CONFIG`: do on this machine what CONFIG's Talker, Code2Wav and Aligner replicas compile
when they start (torch.compile's work into the compile-cache files, the project's Triton kernels into their cache),
then exit. A later `serve run CONFIG` here, or on any machine with the same GPU, torch and serve home
(`QWEN3_TTS_SERVE_HOME`), starts from those files.

Why: a replica compiles its kernels at its first start, which is most of a cold start (docs/results.md, "Start-up");
from the cache a start is the load and the graph captures. A machine image build or a pod's init step on the target
GPU runs this once, so the first `serve run` of a new machine is already a start from the cache.

Each replica is started as its deployment starts it, outside Ray: the same server class (`sync_init` + `start`; the
Talker's first-chunk decoder built too), each in a process of its own, one after the other, with the application's
`runtime_env.env_vars` and the torch thread count its replica gets. That count matters: the compile cache's files are
keyed by it (stages/compile_cache.py: Dynamo guards compiled work on it), and Ray sets a replica's OMP_NUM_THREADS to
its `num_cpus` only where the environment does not set it (the shipped configs set 1 in `env_vars`).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

APP_IMPORT_PATH = "deployments.builder:build_app"


@dataclass(frozen=True)
class Replica:
    """One replica start to do: `kind` "talker" (models[index]), "code2wav" or "aligner" of application `app`."""

    app: int
    kind: str
    index: int
    name: str  # its deployment's name
    env: dict[str, str]  # what the replica's process gets beyond this one's environment


def _read(config_path: str) -> dict:
    config = yaml.safe_load(Path(config_path).read_text())
    return config if isinstance(config, dict) else {}


def _applications(config: dict) -> list[tuple[int, dict]]:
    return [(i, app) for i, app in enumerate(config.get("applications") or [])
            if app.get("import_path") == APP_IMPORT_PATH]


def _serving_args(app: dict):
    from deployments.config import TTSServingArgs

    return TTSServingArgs.model_validate(app.get("args") or {})


def _num_cpus(app: dict, name: str, options: dict) -> float:
    """The replica's `num_cpus`: the builder's options, then the application's `deployments:` override by name."""
    cpus = (options.get("ray_actor_options") or {}).get("num_cpus", 1)
    for override in app.get("deployments") or []:
        if override.get("name") == name:
            cpus = (override.get("ray_actor_options") or {}).get("num_cpus", cpus)
    return cpus


def plan(config: dict, environ: dict[str, str] | None = None) -> list[Replica]:
    """The replica starts that compile: every Talker, then the Code2Wav, then the Aligner where there is one, of every
    application built by `deployments.builder:build_app`. `environ`: the environment `serve run` would start from
    (default: this process's)."""
    environ = os.environ if environ is None else environ
    from deployments.builder import aligner_deployment_options, code2wav_deployment_options, talker_deployment_options

    out = []
    for i, app in _applications(config):
        args = _serving_args(app)
        env_vars = {str(k): str(v) for k, v in ((app.get("runtime_env") or {}).get("env_vars") or {}).items()}
        starts = [("talker", j, talker_deployment_options(m)) for j, m in enumerate(args.models)]
        starts.append(("code2wav", 0, code2wav_deployment_options(args.code2wav)))
        if args.aligner is not None:
            starts.append(("aligner", 0, aligner_deployment_options(args.aligner)))
        for kind, j, options in starts:
            env = dict(env_vars)
            # as Ray does for a replica (ray._private.utils.set_omp_num_threads_if_unset): its num_cpus, floored,
            # at least 1, unless its environment (the application's env_vars, or what the cluster inherited) sets it
            if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in environ:
                env["OMP_NUM_THREADS"] = str(max(1, math.floor(_num_cpus(app, options["name"], options))))
            out.append(Replica(i, kind, j, options["name"], env))
    return out


async def _start(replica: Replica, config: dict) -> str:
    """Start one replica's server as its deployment does; returns what was built."""
    from deployments.aligner.server import AlignerServer
    from deployments.code2wav.server import Code2WavServer
    from deployments.talker.server import TalkerServer

    args = _serving_args(dict(_applications(config))[replica.app])
    if replica.kind == "talker":
        server = TalkerServer.sync_init(args.models[replica.index], args.streaming)
        await server.start()
        built = await server.first_chunk_decoder_built()
        return "engine and first-chunk decoder" if built else "engine (no first-chunk decoder)"
    if replica.kind == "aligner":
        server = AlignerServer.sync_init(args.aligner)
    else:
        server = Code2WavServer.sync_init(args.code2wav, args.codec_source, args.streaming)
    await server.start()
    return "engine"


def _run_one(config_path: str, app: int, kind: str, index: int) -> int:
    config = _read(config_path)
    replica = next(r for r in plan(config) if (r.app, r.kind, r.index) == (app, kind, index))
    import torch

    t0 = time.perf_counter()
    built = asyncio.run(_start(replica, config))
    print(f"prebuilt {replica.name}: {built} in {time.perf_counter() - t0:.1f} s "
          f"(torch threads {torch.get_num_threads()})", flush=True)
    os._exit(0)  # the engines' threads hold nothing to keep: their files are written


def prebuild(config_path: str, log=print) -> int:
    """Start every compiling replica of the config in turn; 0 if all started, else the first failure's code."""
    config = _read(config_path)
    replicas = plan(config)
    if not replicas:
        log(f"qwen3-tts-serve: no application of {config_path} is built by {APP_IMPORT_PATH}: nothing to prebuild")
        return 2
    t0 = time.perf_counter()
    for r in replicas:
        threads = r.env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS"))
        log(f"qwen3-tts-serve: prebuilding {r.name} (OMP_NUM_THREADS={threads})")
        code = subprocess.run([sys.executable, "-m", "deployments.launcher.prebuild", "--one", r.kind, str(r.app),
                               str(r.index), config_path], env={**os.environ, **r.env}).returncode
        if code != 0:
            log(f"qwen3-tts-serve: prebuilding {r.name} failed (exit {code})")
            return code
    log(f"qwen3-tts-serve: prebuilt {len(replicas)} replica start(s) of {config_path} in "
        f"{time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.launcher.prebuild", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "APP", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        kind, app, index = args.one
        return _run_one(args.config, int(app), kind, int(index))
    return prebuild(args.config)


if __name__ == "__main__":
    sys.exit(main())
