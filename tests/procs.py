"""Subprocess helpers shared by the tests that start `serve run` themselves."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
# run as `python -c DEFAULT_SIGINT_EXEC PROGRAM ARGS...`: PROGRAM with SIGINT's default action (Python turns it into
# KeyboardInterrupt only where its parent did not ignore it)
DEFAULT_SIGINT_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                       "os.execv(sys.argv[1], sys.argv[1:])")


def stop_process_group(process: subprocess.Popen, grace_s: float = 60) -> bool:
    """SIGINT the group's leader (`serve run` shuts Serve down, then the Ray cluster it started), SIGKILL it if it
    lingers, then SIGKILL whatever of its group is left. Not SIGINT to the whole group: Ray's GCS would stop at
    once, and the driver would wait out its GCS reconnect timeout (a minute) before exiting. Returns whether the
    leader exited on its own within `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
        on_its_own = True
    except subprocess.TimeoutExpired:
        on_its_own = False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return on_its_own


@contextlib.contextmanager
def serve_run(config_name: str, tmp_path: Path, ready_timeout_s: float = 240,
              env: dict[str, str] | None = None) -> Iterator[tuple[str, Path, Path]]:
    """`serve run` of a shipped config on a free port with an empty QWEN3_TTS_SERVE_HOME (a fresh machine: no
    checkpoint anywhere) and `env` added to the environment; -> (base URL, home, log file) once `/ready` answers
    200. Stopped with SIGINT after."""
    config = yaml.safe_load((REPO / "configs" / config_name).read_text())
    from tests.serve.conftest import free_port

    port = free_port()
    config["http_options"]["port"] = port
    config_path = tmp_path / config_name
    config_path.write_text(yaml.safe_dump(config))
    home = tmp_path / "home"
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(QWEN3_TTS_SERVE_HOME=str(home), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", **extra)
    serve_cli = Path(sys.executable).with_name("serve")
    log_path = tmp_path / "serve_run.log"
    log = open(log_path, "wb")
    # SIGINT restored before `serve run` starts: a suite launched as a background job ignores it, a child would
    # inherit that, and the stop below would wait out its grace (a minute per server) before killing
    process = subprocess.Popen([sys.executable, "-c", DEFAULT_SIGINT_EXEC, str(serve_cli), "run", str(config_path)],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert process.poll() is None, log_path.read_text()[-5000:]
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-5000:]
            time.sleep(1)
        yield url, home, log_path
    finally:
        stopped = stop_process_group(process)
        log.close()
    # a Ctrl-C stops the app and its cluster (seconds; a replica that hung in its shutdown would show here)
    assert stopped, "`serve run` still running 60 s after SIGINT: " + log_path.read_text()[-3000:]
