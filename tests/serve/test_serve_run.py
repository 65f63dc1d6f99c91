"""`serve run configs/<name>.yaml` as a subprocess, on a fresh home: writes the embedded checkpoints, serves audio;
and the load generator (`python -m bench.loadgen`, closed and open loop, as the GPU runbook runs it) against the same
`serve run configs/local.yaml`."""

from __future__ import annotations

import base64
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
from tests.serve.conftest import wav_bytes

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



def test_serve_run_local_all_yaml_serves_every_task_type(tmp_path):
    """configs/local_all.yaml, as a newcomer runs it: CustomVoice, Base cloning (an uploaded voice and an inline
    `ref_audio`) and VoiceDesign, each answering audio over HTTP on CPU (short: `max_new_tokens` 4)."""
    short = {"input": "Hello from every task type.", "max_new_tokens": 4, "suppress_eos": True,
             "response_format": "wav", "stream": False}
    with serve_run("local_all.yaml", tmp_path, ready_timeout_s=420) as (url, home, _log):
        with httpx.Client(base_url=url, timeout=120) as http:
            models = {m["id"]: m["task_type"] for m in http.get("/v1/models").json()["data"]}
            assert models == {"qwen3-tts": "CustomVoice", "qwen3-tts-base": "Base",
                              "qwen3-tts-voicedesign": "VoiceDesign"}

            assert _wav_frames(http.post("/v1/audio/speech", json={"model": "qwen3-tts", "voice": "vivian",
                                                                   **short})) == 4

            upload = http.post("/v1/audio/voices", data={"name": "alice", "ref_text": "What the clip says."},
                               files={"audio_sample": ("clip.wav", wav_bytes(2.0, seed=7), "audio/wav")})
            assert upload.status_code == 200, upload.text[:500]
            assert _wav_frames(http.post("/v1/audio/speech", json={"model": "qwen3-tts-base", "voice": "alice",
                                                                   **short})) == 4
            assert (home / "voices" / "alice" / "meta.json").exists()  # under the default voices_dir

            clip = "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.5, seed=8)).decode()
            assert _wav_frames(http.post("/v1/audio/speech", json={
                "model": "qwen3-tts-clone", "ref_audio": clip, "ref_text": "Another clip.", **short})) == 4

            assert _wav_frames(http.post("/v1/audio/speech", json={
                "model": "qwen3-tts-voicedesign", "instructions": "A calm, low voice.", **short})) == 4
        for kind in ("custom_voice", "base", "voice_design"):
            assert (home / "embedded" / f"{kind}-17b-tiny" / "config.json").exists()
