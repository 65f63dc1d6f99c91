"""CPU smoke run of the load generator against the embedded default: `serve run configs/local.yaml` as a
subprocess (the way the GPU runbook serves), then `python -m bench.loadgen` closed and open loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.bench import REPO
from tests.procs import stop_process_group

pytestmark = [pytest.mark.serve, pytest.mark.slow]  # `serve run` subprocesses

FRAMES = 8
SAMPLES_PER_FRAME = 1920


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def local_server(tmp_path_factory):
    """`serve run configs/local.yaml` on a free port and a fresh home; -> base URL."""
    tmp = tmp_path_factory.mktemp("loadgen_serve")
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    (tmp / "local.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(QWEN3_TTS_SERVE_HOME=str(tmp / "home"), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    log_path = tmp / "serve_run.log"
    log = open(log_path, "wb")
    # --address=local: a cluster of its own even if a `ray start` cluster is recorded on this machine
    process = subprocess.Popen([str(Path(sys.executable).with_name("serve")), "run", "--address=local",
                                str(tmp / "local.yaml")],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = subprocess.run([sys.executable, "-m", "bench.loadgen.ready", "--url", url, "--timeout", "180",
                                "--pid", str(process.pid), "--log", str(log_path),
                                "--fail-on", "Failed to update the deployments"],
                               cwd=REPO, capture_output=True, text=True, timeout=240)
        assert ready.returncode == 0, ready.stdout + log_path.read_text()[-5000:]
        yield url
    finally:
        stop_process_group(process)
        log.close()


def loadgen(out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "bench.loadgen", "--max-new-tokens", str(FRAMES), "--fixed-length",
           "--warmup", "1", "--progress", "plain", "--timeout", "60", "--out", str(out), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "results.json").read_text())


def check_point(point: dict, requests: int) -> None:
    assert (point["ok"], point["failed"], point["aborted"], point["failures"]) == (requests, 0, 0, {})
    assert point["audio_len_s"]["min"] == point["audio_len_s"]["max"] == pytest.approx(FRAMES * 0.08)
    assert 0 < point["ttfa_ms"]["p50"] <= point["ttfa_ms"]["p99"] <= point["e2e_ms"]["max"]
    assert point["rtf"]["n"] == requests and point["audio_s_per_s"] > 0
    assert point["max_deficit_s"]["n"] == requests and point["continuous_share"] is not None
    for row in point["request_rows"]:
        assert row["ok"] and row["pieces"] >= 1 and row["audio_s"] == pytest.approx(FRAMES * 0.08)


def test_closed_and_open_loop_against_the_embedded_default(local_server, tmp_path):
    closed = loadgen(tmp_path / "closed", "--url", local_server, "--mode", "closed", "--concurrency", "2",
                     "--requests", "4")
    assert [p["level"] for p in closed["points"]] == [2] and closed["stop_reason"] is None
    check_point(closed["points"][0], 4)
    assert closed["points"][0]["peak_inflight"] == 2
    assert isinstance(closed["meta"]["server_models"], list)
    md = (tmp_path / "closed" / "results.md").read_text()
    assert "| 2 | 4 / 4 | 0 |" in md

    opened = loadgen(tmp_path / "open", "--url", local_server, "--mode", "open", "--rate", "4", "--requests", "4",
                     "--stream-format", "sse", "--language", "zh", "--no-plots", "--processes", "2",
                     "--extra", '{"timestamps": "word"}')
    check_point(opened["points"][0], 4)  # two worker processes read the streams
    assert opened["meta"]["processes"] == 2
    # word timestamps (the embedded aligner): one event per request after its audio, each with its words
    lag = opened["points"][0]["timestamps_lag_ms"]
    assert lag["n"] == 4 and lag["min"] >= 0 and opened["points"][0]["timestamps_failed"] == 0

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert all((tmp_path / "closed" / f).stat().st_size > 0 for f in ("latency.png", "throughput.png",
                                                                       "continuity.png"))
