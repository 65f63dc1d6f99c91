"""`qwen3-tts-serve CONFIG`: `serve run CONFIG` with the cluster-wide settings that serve it fastest.

Three settings belong to the Ray cluster, not to the Serve config, so a YAML file cannot carry them; they must be in
place before Ray starts (docs/serving.md, "The fastest recipe"):

- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: Serve's throughput-optimized mode (same-loop routing, buffered logs);
- `RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy routes each HTTP connection straight to an ingress replica;
- the CUDA MPS control daemon, so the co-located Talker and Code2Wav processes on a GPU share one MPS server and
  their kernels overlap instead of time-slicing the GPU. Only processes started after the daemon become its
  clients, so it starts before `serve run` starts Ray, and quits after `serve run` ends if this command started it.

A variable already set in the environment wins (`RAY_SERVE_ENABLE_HA_PROXY=0 qwen3-tts-serve ...` opts out). When
`serve run` would join a running cluster (`RAY_ADDRESS` set), nothing here can change that cluster's settings: start
it with `cluster/start_head.sh` / `cluster/start_workers.sh`, which apply the same ones.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

# the fastest measured cluster-wide Serve settings (docs/results.md); each is a default the environment may override
SERVE_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
MPS_CONTROL = "nvidia-cuda-mps-control"


def _log(message: str) -> None:
    print(f"qwen3-tts-serve: {message}", file=sys.stderr, flush=True)


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return listed.returncode == 0 and "GPU" in listed.stdout


def mps_daemon_running(control: str = MPS_CONTROL) -> bool:
    """Whether an MPS control daemon (`CONTROL -d`) runs on this host (read from /proc, as cluster/_common.sh does)."""
    name = os.path.basename(control)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if len(args) >= 2 and os.path.basename(args[0].decode(errors="replace")) == name and args[1] == b"-d":
            return True
    return False


def start_mps(control: str) -> bool:
    """Start the MPS control daemon unless one runs; True if this call started it."""
    if mps_daemon_running(control):
        _log("an MPS control daemon already runs on this host; left as it is")
        return False
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # every GPU of the host
    started = subprocess.run([control, "-d"], env=env, check=False)
    if started.returncode != 0:
        _log(f"`{control} -d` failed (exit {started.returncode}); serving without MPS")
        return False
    _log("started the CUDA MPS control daemon")
    return True


def stop_mps(control: str) -> None:
    """Quit the daemon; `quit` waits for its clients, which are gone once `serve run` has stopped Ray."""
    try:
        subprocess.run([control], input="quit\n", text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        _log("the MPS control daemon did not quit within 60 s")
    for _ in range(40):
        if not mps_daemon_running(control):
            _log("quit the CUDA MPS control daemon")
            return
        time.sleep(0.25)


def serve_environment(environ: dict[str, str]) -> dict[str, str]:
    """The environment for `serve run`: the fast cluster-wide settings, unless the caller set them."""
    env = dict(environ)
    for key, value in SERVE_ENV.items():
        env.setdefault(key, value)
    return env


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen3-tts-serve",
        description="serve run CONFIG with the fastest measured cluster-wide settings (throughput-optimized Serve, "
        "HAProxy ingress, CUDA MPS on GPU hosts). Arguments after the config go to `serve run`.",
    )
    parser.add_argument("config", help="a Serve config, e.g. configs/high_concurrency.yaml")
    parser.add_argument("--no-mps", action="store_true", help="do not start the CUDA MPS control daemon")
    parser.add_argument("--serve", default="serve", help="the `serve` executable (default: serve on PATH)")
    parser.add_argument("--prebuild", action="store_true", help="instead of serving: compile what CONFIG's replicas "
                        "compile at their start, on this machine, and exit (deployments/launcher/prebuild.py)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, serve_args = _parser().parse_known_args(argv)
    if args.prebuild:
        from deployments.launcher.prebuild import prebuild

        if serve_args:
            _log(f"--prebuild starts no `serve run`: {' '.join(serve_args)} not used")
            return 2
        return prebuild(args.config, log=lambda m: print(m, file=sys.stderr, flush=True))
    env = serve_environment(dict(os.environ))
    joins_cluster = bool(env.get("RAY_ADDRESS"))
    if joins_cluster:
        _log("RAY_ADDRESS is set: `serve run` joins that cluster, whose settings were fixed when it started "
             "(cluster/start_head.sh and start_workers.sh apply the fast ones)")
    control = shutil.which(MPS_CONTROL, path=env.get("PATH"))
    use_mps = not args.no_mps and not joins_cluster and control is not None and _has_gpu()
    started_mps = start_mps(control) if use_mps else False
    settings = " ".join(f"{k}={env[k]}" for k in SERVE_ENV)
    _log(f"{settings}; MPS {'on' if use_mps else 'off'}")
    command = [args.serve, "run", args.config, *serve_args]
    children: list[subprocess.Popen] = []

    def forward(signum: int, _frame: object) -> None:
        for child in children:  # `serve run` shuts the app and its local cluster down on SIGINT/SIGTERM
            child.send_signal(signum)

    # installed before the child starts: a signal this process ignores (a background job's SIGINT) would stay
    # ignored in `serve run` too, which then could not be stopped gracefully
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        children.append(subprocess.Popen(command, env=env))
    except FileNotFoundError:
        _log(f"`{args.serve}` not found: install ray[serve]")
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started_mps:
            stop_mps(control)
        return 127
    child = children[0]
    try:
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if started_mps:
            stop_mps(control)
    return code


if __name__ == "__main__":
    sys.exit(main())
