"""Scripts run as forks of one process per interpreter that imported their heavy modules once (a fork server).

The tests run many short scripts in other virtualenvs (the oracles', Triton's) or in fresh processes of our own,
and on 2 cores importing torch, transformers or Triton again in each is a large part of their time. `run` has the
signature of `subprocess.run(..., capture_output=True, text=True)`; the script runs in a child forked from a
server that has imported `preload` and nothing else (it ran no torch op, compiled nothing), under the environment,
arguments, `sys.path[0]` and working directory the plain command would have: what a fresh process started that
way would do. The environment may differ from the server's only in variables read after import (`late_env`);
anything else starts a plain process. `QWEN3_TTS_TESTS_NO_FORKSERVER=1` starts a plain process always.

This file is also the server (`python forkserver.py MODULE ...`): stdlib only, any interpreter runs it.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- the server (runs under the script's interpreter)
def _child(request: dict, replies: int) -> int:
    """In the forked child: become the process `python SCRIPT ARGS` (or `python -c CODE ARGS`) would have been."""
    import atexit
    import runpy
    import threading
    import traceback

    os.close(replies)
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    code, script = request.get("code"), request.get("script")
    sys.argv = ["-c" if code is not None else script, *request["args"]]
    sys.path[0] = "" if code is not None else os.path.dirname(os.path.abspath(script))
    try:
        if code is not None:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        status = 1
    # what the interpreter does at exit: wait for the script's threads, run its exit functions, flush
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def _serve(preload: list[str]) -> None:
    import importlib
    import select

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the imports print never mixes with the replies
    for module in preload:
        importlib.import_module(module)
    print(json.dumps({"ready": True}), file=replies)
    running: dict[int, str] = {}
    pending, stdin_open = b"", True  # os.read, not a buffered readline: select must see every request
    while stdin_open or running:
        if stdin_open and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 20)
            stdin_open = bool(chunk)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    os._exit(_child(request, replies.fileno()))
                running[pid] = request["id"]
                print(json.dumps({"id": request["id"], "pid": pid}), file=replies)
        elif not stdin_open:
            select.select([], [], [], 0.05)
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            print(json.dumps({"id": running.pop(pid), "rc": os.waitstatus_to_exitcode(status)}), file=replies)


# ---------------------------------------------------------------- the client (in the test process)
class _Server:
    def __init__(self, python: str, preload: tuple[str, ...], env: dict[str, str]):
        self.env = env
        self.process = subprocess.Popen([python, str(HERE), *preload], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        env=env, text=True, bufsize=1)
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[str, dict] = {}
        self._events: dict[str, threading.Event] = {}
        assert json.loads(self.process.stdout.readline()).get("ready"), "the fork server did not start"
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            reply = json.loads(line)
            with self._lock:
                if reply["id"] not in self._waiting:  # a run that timed out
                    continue
                self._waiting[reply["id"]].update(reply)
                if "rc" in reply:
                    self._events[reply["id"]].set()
        with self._lock:  # the server died: nobody waits forever
            for event in self._events.values():
                event.set()

    def run(self, request: dict, timeout: float | None) -> int:
        with self._lock:
            self._next += 1
            rid = request["id"] = str(self._next)
            self._waiting[rid], self._events[rid] = {}, threading.Event()
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        try:
            if not self._events[rid].wait(timeout):
                pid = self._waiting[rid].get("pid")
                if pid is not None:
                    os.kill(pid, 9)
                raise subprocess.TimeoutExpired(request.get("script") or "-c", timeout)
            reply = self._waiting[rid]
            if "rc" not in reply:
                raise RuntimeError(f"the fork server exited ({self.process.poll()})")
            return reply["rc"]
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
                self._events.pop(rid, None)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_servers: dict[tuple, _Server] = {}
_servers_lock = threading.Lock()


def _server(python: str, preload: tuple[str, ...], env: dict[str, str], late_env: tuple[str, ...]) -> _Server:
    base = {k: v for k, v in env.items() if k not in late_env}
    key = (python, preload, tuple(sorted(base.items())))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.process.poll() is not None:
            server = _servers[key] = _Server(python, preload, base)
        return server


@atexit.register
def _stop_all() -> None:
    for server in _servers.values():
        server.stop()


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
        timeout: float | None = None, preload: tuple[str, ...] = (), late_env: tuple[str, ...] = ()
        ) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)` for `cmd` of the form
    `[python, SCRIPT, *args]` or `[python, "-c", CODE, *args]`, forked from `python`'s server of `preload`."""
    env = dict(os.environ if env is None else env)
    if os.environ.get("QWEN3_TTS_TESTS_NO_FORKSERVER") == "1" or len(cmd) < 2 or cmd[1].startswith("-") and cmd[1] != "-c":
        return subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, capture_output=True, text=True)
    python, rest = str(cmd[0]), [str(c) for c in cmd[1:]]
    request = {"env": env, "cwd": str(Path(cwd or os.getcwd()).resolve())}
    if rest[0] == "-c":
        request.update(code=rest[1], args=rest[2:])
    else:
        request.update(script=rest[0], args=rest[1:])
    with tempfile.TemporaryDirectory(prefix="forkserver-") as tmp:
        request.update(stdout=f"{tmp}/stdout", stderr=f"{tmp}/stderr")
        rc = _server(python, tuple(preload), env, tuple(late_env)).run(request, timeout)
        out, err = (Path(request[k]).read_text(errors="replace") for k in ("stdout", "stderr"))
    return subprocess.CompletedProcess(cmd, rc, out, err)


if __name__ == "__main__":
    _serve(sys.argv[1:])
