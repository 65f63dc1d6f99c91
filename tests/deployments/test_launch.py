"""`qwen3-tts-serve CONFIG` (deployments/launcher/serve.py) runs `serve run CONFIG` with the fastest measured
settings: the Serve environment variables, and on a GPU host the CUDA MPS control daemon started before Ray and quit
after. Real subprocesses with stand-ins for `serve`, `nvidia-smi` and the MPS control binary on PATH."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOGGER = """#!{python}
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({{"tool": os.path.basename(sys.argv[0]), "argv": sys.argv[1:],
                        "stdin": sys.stdin.read() if sys.argv[1:] == [] else "",
                        "env": [os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED"),
                                os.environ.get("RAY_SERVE_ENABLE_HA_PROXY")],
                        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
if os.path.basename(sys.argv[0]) == "serve" and os.environ.get("FAKE_SERVE_WAIT"):
    open(os.environ["FAKE_SERVE_WAIT"], "w").close()
    import time
    try:
        time.sleep(60)
    except KeyboardInterrupt:  # SIGINT reached `serve run`: it shuts down gracefully
        sys.exit(130)
    sys.exit(0)
if os.path.basename(sys.argv[0]) == "nvidia-smi":
    print("GPU 0: NVIDIA H200 (UUID: GPU-0)")
sys.exit(int(os.environ.get("FAKE_SERVE_EXIT", "0")) if os.path.basename(sys.argv[0]) == "serve" else 0)
"""


def _tools(tmp_path: Path, names: tuple[str, ...]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        tool = bin_dir / name
        tool.write_text(LOGGER.format(python=sys.executable))
        tool.chmod(0o755)
    return bin_dir


def _launch(tmp_path: Path, bin_dir: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    log = tmp_path / "calls.jsonl"
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RAY_ADDRESS", "RAY_SERVE_THROUGHPUT_OPTIMIZED", "RAY_SERVE_ENABLE_HA_PROXY")}
    full_env.update({"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "PYTHONPATH": str(REPO),
                     "CUDA_VISIBLE_DEVICES": "0", **env})
    out = subprocess.run([sys.executable, "-m", "deployments.launcher.serve", *args], capture_output=True, text=True,
                         env=full_env, timeout=120, cwd=tmp_path)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return out, [c for c in calls if c["tool"] != "nvidia-smi"]


def test_gpu_host_gets_mps_before_serve_and_the_fast_serve_settings(tmp_path):
    bin_dir = _tools(tmp_path, ("serve", "nvidia-smi", "nvidia-cuda-mps-control"))
    out, calls = _launch(tmp_path, bin_dir, "configs/high_concurrency.yaml", "--name", "x")
    assert out.returncode == 0, out.stderr
    # the daemon sees every GPU of the host, starts before `serve run` (which starts Ray), and quits after it
    assert [(c["tool"], c["argv"]) for c in calls] == [
        ("nvidia-cuda-mps-control", ["-d"]),
        ("serve", ["run", "configs/high_concurrency.yaml", "--name", "x"]),
        ("nvidia-cuda-mps-control", []),
    ]
    assert calls[0]["cvd"] is None and calls[2]["stdin"] == "quit\n"
    assert calls[1]["env"] == ["1", "1"]
    assert "MPS on" in out.stderr


def test_opt_outs_and_exit_status(tmp_path):
    bin_dir = _tools(tmp_path, ("serve", "nvidia-smi", "nvidia-cuda-mps-control"))
    out, calls = _launch(tmp_path, bin_dir, "configs/high_concurrency.yaml", "--no-mps",
                         RAY_SERVE_ENABLE_HA_PROXY="0", FAKE_SERVE_EXIT="3")
    assert out.returncode == 3  # serve run's status is the command's
    assert [c["tool"] for c in calls] == ["serve"] and calls[0]["env"] == ["1", "0"]


def test_host_without_gpu_or_joining_a_cluster_starts_no_daemon(tmp_path):
    bin_dir = _tools(tmp_path, ("serve", "nvidia-cuda-mps-control"))  # no nvidia-smi: no GPU
    out, calls = _launch(tmp_path, bin_dir, "configs/local.yaml")
    assert out.returncode == 0 and [c["tool"] for c in calls] == ["serve"] and "MPS off" in out.stderr
    (bin_dir / "nvidia-smi").write_text(LOGGER.format(python=sys.executable))
    (bin_dir / "nvidia-smi").chmod(0o755)
    (tmp_path / "calls.jsonl").unlink()
    out, calls = _launch(tmp_path, bin_dir, "configs/local.yaml", RAY_ADDRESS="10.0.0.1:6379")
    assert out.returncode == 0 and [c["tool"] for c in calls] == ["serve"]
    assert "joins that cluster" in out.stderr


def test_sigint_reaches_serve_run_even_when_started_as_a_background_job(tmp_path):
    """A background job starts with SIGINT ignored, and `serve run` would inherit that; the launcher's own handler
    forwards the signal, so stopping the launcher stops `serve run` gracefully and then quits the daemon."""
    bin_dir = _tools(tmp_path, ("serve", "nvidia-smi", "nvidia-cuda-mps-control"))
    started, log = tmp_path / "serve.started", tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_LOG": str(log), "PYTHONPATH": str(REPO),
                "FAKE_SERVE_WAIT": str(started)})
    launcher = subprocess.Popen([sys.executable, "-m", "deployments.launcher.serve", "configs/high_concurrency.yaml"],
                                env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        while not started.exists():  # the stand-in `serve run` is up
            assert launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.05)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 130
    finally:
        launcher.kill()
    tools = [json.loads(line)["tool"] for line in log.read_text().splitlines()]
    assert tools[-1] == "nvidia-cuda-mps-control"  # quit after serve run ended
