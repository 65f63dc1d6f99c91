"""`serve run configs/local.yaml` as a subprocess, on a fresh home: writes the embedded checkpoint, serves audio."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import soundfile as sf
import yaml

from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.procs import stop_process_group
from tests.serve.conftest import free_port

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]


def test_serve_run_local_yaml_serves_the_embedded_checkpoint(tmp_path):
    config = yaml.safe_load((REPO / "configs" / "local.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config_path = tmp_path / "local.yaml"
    config_path.write_text(yaml.safe_dump(config))
    home = tmp_path / "home"  # a fresh machine: no checkpoint anywhere
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(QWEN3_TTS_SERVE_HOME=str(home), RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    serve_cli = Path(sys.executable).with_name("serve")
    log = open(tmp_path / "serve_run.log", "wb")
    process = subprocess.Popen([str(serve_cli), "run", str(config_path)], cwd=REPO, env=env, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, (tmp_path / "serve_run.log").read_text()[-5000:]
            try:
                if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve_run.log").read_text()[-5000:]
            time.sleep(1)
        response = httpx.post(f"{url}/v1/audio/speech", timeout=120, json={
            "model": "tts-1", "voice": "vivian", "input": "Hello from serve run.", "max_new_tokens": 5,
            "suppress_eos": True})
        assert response.status_code == 200, response.text
        audio, sr = sf.read(io.BytesIO(response.content), dtype="int16")
        assert sr == SAMPLE_RATE and audio.shape == (5 * SAMPLES_PER_FRAME,)
        assert (home / "embedded" / "custom_voice-17b-tiny" / "config.json").exists()
        assert b"[embedded]" in (tmp_path / "serve_run.log").read_bytes()  # progress was printed
    finally:
        stop_process_group(process)
        log.close()
