"""Disconnects cancel generation and free the engine slot; uploaded voices persist across an ingress restart."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import pytest

from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import PAUSE_SEED, engine_stats, pcm_of, replica_pids, speech, wait_for, wav_bytes

pytestmark = pytest.mark.serve


def test_client_disconnect_cancels_generation_and_frees_the_slot(base_url):
    """Events, no race: the request (the fake engine's PAUSE_SEED) gets a few frames and then none, so it can never
    end by itself; its first audio arrives while the engine shows its row running; the client disconnects; the row
    is freed, which only the abort can do."""
    wait_for(lambda: engine_stats("fake")["running"] == 0, 30, 0.05, "an idle engine")
    with httpx.Client(base_url=base_url, timeout=60) as client:
        body = speech(model="fake", response_format="pcm", stream=True, max_new_tokens=400, seed=PAUSE_SEED)
        with client.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            # the iterator is held: a dropped httpx iterator closes the connection before the check below
            chunks = response.iter_bytes()
            assert len(next(chunks)) > 0  # first audio arrived...
            wait_for(lambda: engine_stats("fake")["running"] == 1, 60, 0.02, "the request's row")  # ...and it runs
        # leaving the block closes the connection with the stream still open
    wait_for(lambda: engine_stats("fake")["running"] == 0, 60, 0.02, "the aborted request's row to be freed")
    assert engine_stats("fake")["waiting"] == 0


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

    listed = http.get("/v1/audio/voices").json()  # the session's voices dir: other tests' voices may be there
    assert {"Me", "xv"} <= {v["name"] for v in listed["uploaded_voices"]}
    assert "vivian" in listed["voices"] and {"Me", "xv"} <= set(listed["models"]["base"]["voices"])

    body = speech(model="base", voice="me", response_format="pcm", max_new_tokens=7, seed=11)
    before = http.post("/v1/audio/speech", json=body)
    assert before.status_code == 200, before.text
    assert len(pcm_of(before.content)) == 7 * SAMPLES_PER_FRAME

    old = set(replica_pids("TTSIngress"))
    _kill_ingress()  # Serve replaces the replica; the new one starts with empty caches
    # ray.kill returns before the process is gone: /ready could still be the old replica's answer
    wait_for(lambda: not old & set(replica_pids("TTSIngress")) and replica_pids("TTSIngress"), 300, 0.25,
             "the killed ingress replaced")
    wait_for(lambda: _ready(base_url), 300, 0.25, "a new ingress replica")
    after = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=120)
    assert after.status_code == 200, after.text
    # same voice, same seed: the same codes; the PCM within 1 LSB, since which chunks Code2Wav decodes together
    # (batch padding) changes float rounding (docs/serving.md, "Known limits")
    np.testing.assert_allclose(pcm_of(after.content).astype(np.int32), pcm_of(before.content).astype(np.int32),
                               rtol=0, atol=1)
    assert prompt_file.stat().st_mtime_ns == computed_at  # read from disk, not computed again
    voices = httpx.get(f"{base_url}/v1/audio/voices", timeout=60).json()["uploaded_voices"]
    assert {v["name"] for v in voices} == {"Me", "xv"}

    for name in ("Me", "xv"):
        deleted = httpx.delete(f"{base_url}/v1/audio/voices/{name}", timeout=60)
        assert deleted.json() == {"success": True, "name": name}
    gone = httpx.post(f"{base_url}/v1/audio/speech", json=body, timeout=60)
    assert gone.status_code == 400 and gone.json()["error"]["code"] == "voice_not_found"
