"""`serve run configs/local.yaml` as a subprocess, on a fresh home: writes the embedded checkpoints, serves audio;
and the load generator (`python -m bench.loadgen`, closed and open loop, as the GPU runbook runs it) against it.
`serve run configs/local_all.yaml` is checked the same way by tests/browser/test_playground.py, on the server its
page tests use."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import soundfile as sf

from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.audio_decode import decode
from tests.procs import REPO, serve_run

pytestmark = [pytest.mark.serve, pytest.mark.slow]  # `serve run` subprocesses

FRAMES = 8  # the load generator's fixed output length


@pytest.fixture(scope="class")
def local_yaml(tmp_path_factory):
    """`serve run configs/local.yaml` on a fresh home -> (base URL, home, log file): one start for TestLocalYaml's
    tests, stopped before the next test starts its own."""
    with serve_run("local.yaml", tmp_path_factory.mktemp("local_yaml")) as started:
        yield started


def _wav_frames(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text[:500]
    audio, sr = sf.read(io.BytesIO(response.content), dtype="int16")
    assert sr == SAMPLE_RATE and audio.ndim == 1 and audio.size % SAMPLES_PER_FRAME == 0
    return audio.size // SAMPLES_PER_FRAME


def _loadgen(out: Path, *args: str) -> dict:
    cmd = [sys.executable, "-m", "bench.loadgen", "--max-new-tokens", str(FRAMES), "--fixed-length",
           "--warmup", "1", "--progress", "plain", "--timeout", "60", "--out", str(out), *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads((out / "results.json").read_text())


def _check_point(point: dict, requests: int) -> None:
    assert (point["ok"], point["failed"], point["aborted"], point["failures"]) == (requests, 0, 0, {})
    assert point["audio_len_s"]["min"] == point["audio_len_s"]["max"] == pytest.approx(FRAMES * 0.08)
    assert 0 < point["ttfa_ms"]["p50"] <= point["ttfa_ms"]["p99"] <= point["e2e_ms"]["max"]
    assert point["rtf"]["n"] == requests and point["audio_s_per_s"] > 0
    assert point["max_deficit_s"]["n"] == requests and point["continuous_share"] is not None
    for row in point["request_rows"]:
        assert row["ok"] and row["pieces"] >= 1 and row["audio_s"] == pytest.approx(FRAMES * 0.08)


class TestLocalYaml:
    def test_serve_run_local_yaml_serves_the_embedded_checkpoint(self, local_yaml):
        url, home, log_path = local_yaml
        response = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
            "model": "tts-1", "voice": "vivian", "input": "Hello from serve run.", "max_new_tokens": 5,
            "suppress_eos": True, "response_format": "wav", "stream": False})
        assert _wav_frames(response) == 5
        # OpenAI's defaults: mp3, streamed
        default = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
            "model": "tts-1", "voice": "alloy", "input": "Hello.", "max_new_tokens": 5, "suppress_eos": True})
        assert default.status_code == 200 and default.headers["content-type"] == "audio/mpeg", default.text[:300]
        audio, rate = decode(default.content, "mp3")
        assert default.headers.get("transfer-encoding") == "chunked" and rate == SAMPLE_RATE and audio.size > 0
        assert (home / "embedded" / "custom_voice-17b-tiny" / "config.json").exists()
        assert (home / "embedded" / "aligner-tiny" / "config.json").exists()  # the Aligner started too
        timed = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
            "model": "tts-1", "voice": "vivian", "input": "Hello from serve run.", "max_new_tokens": 5,
            "suppress_eos": True, "response_format": "wav", "stream": False, "timestamps": "word"})
        assert timed.status_code == 200, timed.text[:300]
        assert [w["word"] for w in timed.json()["words"]] == ["Hello", "from", "serve", "run"]  # the embedded aligner
        assert b"[embedded]" in log_path.read_bytes()  # progress was printed

    def test_the_load_generator_runs_closed_and_open_loops_against_it(self, local_yaml, tmp_path):
        url, _home, log_path = local_yaml
        ready = subprocess.run([sys.executable, "-m", "bench.loadgen.ready", "--url", url, "--timeout", "60",
                                "--log", str(log_path), "--fail-on", "Failed to update the deployments"],
                               cwd=REPO, capture_output=True, text=True, timeout=120)
        assert ready.returncode == 0, ready.stdout + ready.stderr  # the runbook's wait for /ready
        closed = _loadgen(tmp_path / "closed", "--url", url, "--mode", "closed", "--concurrency", "2", "--requests", "4")
        assert [p["level"] for p in closed["points"]] == [2] and closed["stop_reason"] is None
        _check_point(closed["points"][0], 4)
        assert closed["points"][0]["peak_inflight"] == 2
        assert isinstance(closed["meta"]["server_models"], list)
        md = (tmp_path / "closed" / "results.md").read_text()
        assert "| 2 | 4 / 4 | 0 |" in md

        opened = _loadgen(tmp_path / "open", "--url", url, "--mode", "open", "--rate", "4", "--requests", "4",
                          "--stream-format", "sse", "--language", "zh", "--no-plots", "--processes", "2",
                          "--extra", '{"timestamps": "word"}')
        _check_point(opened["points"][0], 4)  # two worker processes read the streams
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
