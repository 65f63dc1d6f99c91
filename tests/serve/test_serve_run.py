"""`serve run configs/<name>.yaml` as a subprocess, on a fresh home: writes the embedded checkpoints, serves audio."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
import soundfile as sf

from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.audio_decode import decode
from tests.procs import serve_run
from tests.serve.conftest import wav_bytes

pytestmark = [pytest.mark.serve, pytest.mark.slow]  # `serve run` subprocesses



def _wav_frames(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text[:500]
    audio, sr = sf.read(io.BytesIO(response.content), dtype="int16")
    assert sr == SAMPLE_RATE and audio.ndim == 1 and audio.size % SAMPLES_PER_FRAME == 0
    return audio.size // SAMPLES_PER_FRAME


def test_serve_run_local_yaml_serves_the_embedded_checkpoint(tmp_path):
    with serve_run("local.yaml", tmp_path) as (url, home, log_path):
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
