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
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

APP_IMPORT_PATH = "deployments.builder:build_app"
REPLICA_TIMEOUT_S = 1800.0  # one replica's prebuild at most (a cold 1.7B Talker takes ~2 minutes on an H200)


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
    # Serve imports either form
    paths = (APP_IMPORT_PATH, APP_IMPORT_PATH.replace(":", "."))
    return [(i, app) for i, app in enumerate(config.get("applications") or []) if app.get("import_path") in paths]


def _env_vars(options: dict) -> dict[str, str]:
    """The `runtime_env.env_vars` of an application or of a deployment's `ray_actor_options`, as strings."""
    return {str(k): str(v) for k, v in ((options.get("runtime_env") or {}).get("env_vars") or {}).items()}


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `env` on top while the block runs: Serve builds an application in a task that has the
    application's env_vars, so its `${VAR}` references (deployments/config/common.py) see them."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _serving_args(app: dict):
    from deployments.config import TTSServingArgs

    with _environment(_env_vars(app)):
        return TTSServingArgs.model_validate(app.get("args") or {})


def _actor_options(app: dict, name: str, options: dict) -> dict:
    """The replica's `ray_actor_options`: the builder's, unless the application's `deployments:` entry of that name
    gives its own (Serve takes that dict whole, and a `num_cpus` it lacks is 1)."""
    actor = options.get("ray_actor_options") or {}
    for override in app.get("deployments") or []:
        if override.get("name") == name and "ray_actor_options" in override:
            actor = override["ray_actor_options"] or {}
    return actor


def plan(config: dict, environ: dict[str, str] | None = None) -> list[Replica]:
    """The replica starts that compile: every Talker, then the Code2Wav, then the Aligner where there is one, of every
    application built by `deployments.builder:build_app`. `environ`: the environment `serve run` would start from
    (default: this process's)."""
    environ = os.environ if environ is None else environ
    from deployments.builder import aligner_deployment_options, code2wav_deployment_options, talker_deployment_options

    out = []
    for i, app in _applications(config):
        args = _serving_args(app)
        env_vars = _env_vars(app)
        starts = [("talker", j, talker_deployment_options(m)) for j, m in enumerate(args.models)]
        starts.append(("code2wav", 0, code2wav_deployment_options(args.code2wav)))
        if args.aligner is not None:
            starts.append(("aligner", 0, aligner_deployment_options(args.aligner)))
        for kind, j, options in starts:
            actor = _actor_options(app, options["name"], options)
            env = {**env_vars, **_env_vars(actor)}  # the deployment's own over the application's, as Serve merges
            # as Ray does for a replica (ray._private.utils.set_omp_num_threads_if_unset): its num_cpus, floored,
            # at least 1, unless its environment (the env_vars, or what the cluster inherited) sets it
            if "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in environ:
                env["OMP_NUM_THREADS"] = str(max(1, math.floor(actor.get("num_cpus", 1))))
            out.append(Replica(i, kind, j, options["name"], env))
    return out


async def _start(replica: Replica, config: dict) -> str:
    """Start one replica's server as its deployment does; returns what was built."""
    from deployments.aligner.server import AlignerServer
    from deployments.code2wav.server import Code2WavServer
    from deployments.talker.server import TalkerServer

    args = _serving_args(dict(_applications(config))[replica.app])
    if replica.kind == "talker":
        model = args.models[replica.index]
        server = TalkerServer.sync_init(model, args.streaming)
        await server.start()
        built = await server.first_chunk_decoder_built()
        if model.decodes_first_chunks and not built:  # its build logged why; its compiled work was not written
            raise RuntimeError(f"{replica.name}: the first-chunk decoder's build failed")
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
    try:
        built = asyncio.run(_start(replica, config))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    print(f"prebuilt {replica.name}: {built} in {time.perf_counter() - t0:.1f} s "
          f"(torch threads {torch.get_num_threads()}; Inductor's cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR')})",
          flush=True)
    os._exit(0)  # the engines' threads hold nothing to keep: their files are written


def prebuild(config_path: str, log=print, timeout_s: float = REPLICA_TIMEOUT_S) -> int:
    """Start every compiling replica of the config in turn; 0 if all started, else the first failure's code (128 +
    the signal for one killed; 124 for one past `timeout_s`, whose process group is killed)."""
    config = _read(config_path)
    replicas = plan(config)
    if not replicas:
        log(f"qwen3-tts-serve: no application of {config_path} is built by {APP_IMPORT_PATH}: nothing to prebuild")
        return 2
    t0 = time.perf_counter()
    for r in replicas:
        threads = r.env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS"))
        log(f"qwen3-tts-serve: prebuilding {r.name} (OMP_NUM_THREADS={threads})")
        with _inductor_cache(r) as private:
            code = _run_child([sys.executable, "-m", "deployments.launcher.prebuild", "--one", r.kind, str(r.app),
                               str(r.index), config_path], {**os.environ, **r.env, **private}, timeout_s)
        if code != 0:
            log(f"qwen3-tts-serve: prebuilding {r.name} failed (exit {code})")
            return code
    log(f"qwen3-tts-serve: prebuilt {len(replicas)} replica start(s) of {config_path} in "
        f"{time.perf_counter() - t0:.0f} s")
    return 0


@contextlib.contextmanager
def _inductor_cache(replica: Replica) -> Iterator[dict[str, str]]:
    """The environment that gives a Talker's or Code2Wav's start an empty Inductor cache of its own, removed after.

    Their compiled work goes into the serve home's compile-cache files, and a start that found another start's
    compiled graphs in Inductor's local cache (the Talker's first-chunk decoder compiles the vocoder too) wrote a
    file that lacked some of its own work, which the served replica then traced and compiled again (docs/benchmarks.md,
    "The stateful decode's carry in one kernel; prebuilt files that are complete"). The Aligner keeps no file: it
    compiles into Inductor's own cache, where its work outlives the prebuild on this machine."""
    if replica.kind == "aligner":
        yield {}
        return
    with tempfile.TemporaryDirectory(prefix="qwen3-tts-prebuild-inductor-") as inductor:
        yield {"TORCHINDUCTOR_CACHE_DIR": inductor}


def _run_child(command: list[str], env: dict[str, str], timeout_s: float) -> int:
    """The child in a process group of its own, killed with it on a timeout or when this process is told to stop
    (SIGTERM / SIGINT: a pod's init step cancelled), so no half-started engine is left holding the GPU."""
    child = subprocess.Popen(command, env=env, start_new_session=True)

    def stop(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = child.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return 124
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.launcher.prebuild", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--timeout", type=float, default=REPLICA_TIMEOUT_S, help="seconds per replica start")
    parser.add_argument("--one", nargs=3, metavar=("KIND", "APP", "INDEX"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        kind, app, index = args.one
        return _run_one(args.config, int(app), kind, int(index))
    return prebuild(args.config, timeout_s=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
