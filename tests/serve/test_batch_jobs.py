"""Batch jobs through the real app: submit, follow, download (by hand and with the CLI), refuse a bad item,
cancel a running job (its Talker request ends)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import soundfile as sf

from deployments.ingress import batch_cli
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME
from tests.serve.conftest import engine_stats, pcm_of, speech, wait_for

pytestmark = pytest.mark.serve
API = "/v1/audio/speech/batches"


def _ended(http, job_id: str):
    job = http.get(f"{API}/{job_id}").json()
    return job if job["status"] in ("completed", "failed", "cancelled") else None


def test_a_job_synthesizes_each_item_as_speech_would(http):
    bodies = [speech(seed=11, response_format="pcm"), speech(seed=12, max_new_tokens=5)]
    r = http.post(API, json={"requests": bodies})
    assert r.status_code == 202, r.text
    job = wait_for(lambda: _ended(http, r.json()["id"]), 120, 0.2, "the job to end")
    assert (job["status"], job["completed"], job["failed"], job["total"]) == ("completed", 2, 0, 2)

    pcm = http.get(f"{API}/{job['id']}/items/0")
    assert pcm.status_code == 200 and pcm.headers["content-type"] == "audio/pcm"
    # the same seed gives the same audio as /v1/audio/speech, though the Talker ran it at batch priority (the same
    # codes; a decode batched with other streams, or by the Talker's first-chunk decoder, rounds a sample apart)
    spoken = pcm_of(http.post("/v1/audio/speech", json=bodies[0]).content)
    np.testing.assert_allclose(pcm_of(pcm.content), spoken, rtol=0, atol=8)
    wav = http.get(f"{API}/{job['id']}/items/1")
    audio, sr = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert sr == SAMPLE_RATE and audio.shape == (5 * SAMPLES_PER_FRAME,)


def test_a_bad_item_is_a_400_naming_its_index(http):
    r = http.post(API, json={"requests": [speech(), speech(voice="nobody")]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "requests[1].voice" and error["code"] == "voice_not_found"
    assert error["message"].startswith("requests[1]: unknown voice")


def test_cancel_ends_the_running_items_talker_request(http):
    long = speech(max_new_tokens=400, seed=5)  # runs for a while on CPU: cancelled mid-way
    r = http.post(API, json={"requests": [long, long]})
    job_id = r.json()["id"]
    wait_for(lambda: http.get(f"{API}/{job_id}").json()["running"] >= 1, 60, 0.1, "an item to run")
    wait_for(lambda: engine_stats("cv")["running"] >= 1, 60, 0.1, "the Talker to run it")
    cancelled = http.delete(f"{API}/{job_id}")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    wait_for(lambda: engine_stats("cv")["running"] == 0 and engine_stats("cv")["waiting"] == 0, 60, 0.1,
             "the Talker to drop the cancelled items")
    item = http.get(f"{API}/{job_id}/items/0")
    assert item.status_code == 409 and item.json()["error"]["code"] == "cancelled"


def test_the_cli_submits_a_file_and_downloads_every_item(base_url, tmp_path):
    lines = [speech(seed=21, max_new_tokens=4), speech(seed=22, max_new_tokens=3, response_format="flac")]
    source = tmp_path / "requests.jsonl"
    source.write_text("".join(json.dumps(b) + "\n" for b in lines))
    out = tmp_path / "out"
    assert batch_cli.main([str(source), str(out), "--url", base_url, "--poll-s", "0.2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["0.wav", "1.flac", "errors.jsonl"]
    for name, frames in (("0.wav", 4), ("1.flac", 3)):
        audio, sr = sf.read(out / name, dtype="int16")
        assert sr == SAMPLE_RATE and audio.shape == (frames * SAMPLES_PER_FRAME,)
    assert (out / "errors.jsonl").read_text() == ""
