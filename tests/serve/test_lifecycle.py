"""Disconnects cancel generation and free the engine slot; uploaded voices persist across an ingress restart."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import engine_stats, pcm_of, speech, wait_for, wav_bytes

pytestmark = pytest.mark.serve


def test_client_disconnect_cancels_generation_and_frees_the_slot(base_url):
    max_frames = 470  # as long as the test engine's 512-position slots allow: cancellation must beat it
    # start from an idle engine: requests of earlier tests may still be finishing
    wait_for(lambda: engine_stats("cv")["running"] == 0, 30, 0.05, "an idle engine")
    before = engine_stats("cv")
    with httpx.Client(base_url=base_url, timeout=60) as client:
        body = speech(response_format="pcm", stream=True, max_new_tokens=max_frames)
        with client.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            # the iterator is held: a `next(response.iter_bytes())` drops it at once, and a dropped httpx iterator
            # closes the connection, which raced this check against the cancellation (a CI failure, 2026-11-25)
            chunks = response.iter_bytes()
            first = next(chunks)
            assert len(first) > 0 and engine_stats("cv")["running"] == 1
            disconnected = time.monotonic()
        # leaving the block closes the connection with most of the audio unread
    wait_for(lambda: engine_stats("cv")["running"] == 0, 15, 0.02, "the slot to be freed")
    freed_after = time.monotonic() - disconnected
    after = engine_stats("cv")
    generated = after["frames"] - before["frames"]
    report = f"slot freed {freed_after * 1000:.0f} ms after the disconnect; {generated}/{max_frames} frames generated"
    print(report)
    assert after["waiting"] == 0, report
    assert generated < max_frames, "the request ran to its end: " + report  # the event: cancelled mid-way


def _kill_ingress() -> None:
    import ray

    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "TTSIngress" in a["name"]]
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/ready", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_uploaded_voice_survives_an_ingress_restart(http, serve_app):
    base_url, args = serve_app
    voices_dir = Path(args["ingress"]["voices_dir"])
    upload = http.post("/v1/audio/voices", files={"audio_sample": ("me.wav", wav_bytes(2.0, seed=5), "audio/wav")},
                       data={"name": "Me", "ref_text": "A reference sentence."})
    assert upload.status_code == 200, upload.text
    voice = upload.json()["voice"]
    assert voice["name"] == "Me" and voice["ref_text"] == "A reference sentence." and not voice["x_vector_only_mode"]
    (prompt_file,) = (voices_dir / "Me").glob("prompt-*.npz")  # computed once, for the one Base model
    computed_at = prompt_file.stat().st_mtime_ns

    # JSON upload (base64), x-vector only
    clip = base64.b64encode(wav_bytes(1.0, seed=6)).decode()
    assert http.post("/v1/audio/voices", json={"name": "xv", "audio_sample": clip}).json()["voice"][
        "x_vector_only_mode"]

    listed = http.get("/v1/audio/voices").json()
    assert {v["name"] for v in listed["uploaded_voices"]} == {"Me", "xv"}
    assert "vivian" in listed["voices"] and sorted(listed["models"]["base"]["voices"]) == ["Me", "xv"]

    body = speech(model="base", voice="me", response_format="pcm", max_new_tokens=7, seed=11)
    before = http.post("/v1/audio/speech", json=body)
    assert before.status_code == 200, before.text
    assert len(pcm_of(before.content)) == 7 * SAMPLES_PER_FRAME

    _kill_ingress()  # Serve replaces the replica; the new one starts with empty caches
    wait_for(lambda: _ready(base_url), 60, 0.25, "a new ingress replica")
    after = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=120)
    assert after.status_code == 200, after.text
    # same voice, same seed: the same codes; the PCM within 1 LSB, since which chunks Code2Wav decodes together
    # (batch padding) changes float rounding (docs/serving.md, "Known limits")
    np.testing.assert_allclose(pcm_of(after.content).astype(np.int32), pcm_of(before.content).astype(np.int32),
                               rtol=0, atol=1)
    assert prompt_file.stat().st_mtime_ns == computed_at  # read from disk, not computed again
    assert {v["name"] for v in httpx.get(f"{base_url}/v1/audio/voices").json()["uploaded_voices"]} == {"Me", "xv"}

    for name in ("Me", "xv"):
        assert httpx.delete(f"{base_url}/v1/audio/voices/{name}").json() == {"success": True, "name": name}
    gone = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=60)
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "voice_not_found"
