"""`serve run configs/<name>.yaml` as a subprocess, on a fresh home: writes the embedded checkpoints, serves audio."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile as sf
import yaml

from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.procs import stop_process_group
from tests.serve.conftest import free_port, wav_bytes

pytestmark = [pytest.mark.serve, pytest.mark.slow]  # `serve run` subprocesses

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def serve_run(config_name: str, tmp_path: Path, ready_timeout_s: float = 240) -> Iterator[tuple[str, Path, Path]]:
    """`serve run` of a shipped config on a free port with an empty QWEN3_TTS_SERVE_HOME (a fresh machine: no
    checkpoint anywhere); -> (base URL, home, log file) once `/ready` answers 200. Stopped with SIGINT after."""
    config = yaml.safe_load((REPO / "configs" / config_name).read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config_path = tmp_path / config_name
    config_path.write_text(yaml.safe_dump(config))
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(QWEN3_TTS_SERVE_HOME=str(home), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    serve_cli = Path(sys.executable).with_name("serve")
    log_path = tmp_path / "serve_run.log"
    log = open(log_path, "wb")
    process = subprocess.Popen([str(serve_cli), "run", str(config_path)], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
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
        stop_process_group(process)
        log.close()


def _wav_frames(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text[:500]
    audio, sr = sf.read(io.BytesIO(response.content), dtype="int16")
    assert sr == SAMPLE_RATE and audio.ndim == 1 and audio.size % SAMPLES_PER_FRAME == 0
    return audio.size // SAMPLES_PER_FRAME


def test_serve_run_local_yaml_serves_the_embedded_checkpoint(tmp_path):
    with serve_run("local.yaml", tmp_path) as (url, home, log_path):
        response = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
            "model": "tts-1", "voice": "vivian", "input": "Hello from serve run.", "max_new_tokens": 5,
            "suppress_eos": True})
        assert _wav_frames(response) == 5
        assert (home / "embedded" / "custom_voice-17b-tiny" / "config.json").exists()
        assert b"[embedded]" in log_path.read_bytes()  # progress was printed


def test_serve_run_local_all_yaml_serves_every_task_type(tmp_path):
    """configs/local_all.yaml, as a newcomer runs it: CustomVoice, Base cloning (an uploaded voice and an inline
    `ref_audio`) and VoiceDesign, each answering audio over HTTP on CPU (short: `max_new_tokens` 4)."""
    short = {"input": "Hello from every task type.", "max_new_tokens": 4, "suppress_eos": True}
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
