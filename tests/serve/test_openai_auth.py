"""A drop-in for OpenAI clients, safe to expose: the real app with API keys and two ingress replicas.

OpenAI's voice names and defaults through the `openai` client, the request bodies of Open WebUI, LiteLLM and Home
Assistant unchanged, keys on HTTP and the WebSocket (missing, wrong, wrong scope, right, reloaded), voice ownership,
per-key limits counted across both ingress replicas, webm and m4a uploads, and hostile requests with auth on.
"""

from __future__ import annotations

import base64
import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from deployments.ingress.api_keys import key_digest
from deployments.ingress.voice_aliases import DEFAULT_VOICE_ALIASES
from tests.audio_decode import RECORDED, decode, recorded_clip
from tests.serve.conftest import PAUSE_SEED, ZERO_CPU, wait_for, wav_bytes

pytestmark = pytest.mark.serve

APP_NAME = "openai-auth"
ALICE, BOB, ADMIN, UPLOADER = "sk-alice-1111", "sk-bob-2222", "sk-admin-3333", "sk-voices-4444"
ONE_STREAM, THREE_A_MINUTE = "sk-one-stream-5555", "sk-rate-6666"
KEYS = f"""# test keys
{ALICE} speech,voices
{BOB}   speech,voices
{ADMIN} admin
{UPLOADER} voices
{ONE_STREAM} speech streams=1 rpm=0
{THREE_A_MINUTE} speech rpm=3
"""


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api_keys"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_custom_voice, tiny_base, keys_file, tmp_path_factory):
    from ray import serve

    from deployments.builder import build_app

    def model(name, path, **extra):
        return {"name": name, "model": str(path), "device": "cpu", "cpu_threads": 1, "default_max_new_tokens": 6,
                "engine_kwargs": {"max_num_seqs": 4, "max_seq_len": 512}, "deployment_config": ZERO_CPU, **extra}

    args = {
        "models": [model("cv", tiny_custom_voice), model("base", tiny_base),
                   {**model("fake", tiny_custom_voice), "engine_cls": "tests.fake_engine:FakeTalkerEngine",
                    "engine_kwargs": {"max_num_seqs": 4, "max_seq_len": 512, "pause_seed": PAUSE_SEED,
                                      "pause_after_frames": 4}}],
        "code2wav": {"device": "cpu", "cpu_threads": 1, "max_batch_size": 8, "deployment_config": ZERO_CPU},
        "streaming": {"steady_chunk_frames": 8, "left_context_frames": 4},
        "ingress": {"voices_dir": str(tmp_path_factory.mktemp("voices")), "max_ref_audio_seconds": 5.0,
                    "max_input_chars": 300, "allow_suppress_eos": True, "auth": {"keys_file": str(keys_file)},
                    "deployment_config": {**ZERO_CPU, "num_replicas": 2}},  # limits must hold across both
    }
    serve.run(build_app(args), name=APP_NAME, route_prefix=f"/{APP_NAME}")
    base_url = f"{ray_cluster}/{APP_NAME}"
    wait_for(lambda: httpx.get(f"{base_url}/ready", timeout=10).status_code == 200, 180, 0.5, "/ready")
    yield base_url
    serve.delete(APP_NAME, _blocking=False)  # no later test deploys this name: its replicas stop meanwhile


@pytest.fixture
def http(app):
    with httpx.Client(base_url=app, timeout=120) as client:
        yield client


def _is_mp3(data: bytes) -> bool:
    return data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0)


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert code is None or error["code"] == code, error
    return error


# ------------------------------------------------------------------ OpenAI clients
def test_every_openai_voice_through_the_openai_client_streams_mp3_by_default(app):
    from openai import OpenAI

    client = OpenAI(base_url=f"{app}/v1", api_key=ALICE, max_retries=0, timeout=120)
    for voice in DEFAULT_VOICE_ALIASES:
        with client.audio.speech.with_streaming_response.create(model="tts-1", voice=voice, input="Hello there.") as r:
            assert r.headers["content-type"] == "audio/mpeg" and r.headers.get("transfer-encoding") == "chunked"
            data = r.read()
        assert _is_mp3(data) and decode(data, "mp3")[0].size > 0, voice
    whole = client.audio.speech.create(model="gpt-4o-mini-tts", voice="onyx", input="Whole.",
                                       extra_body={"stream": False})
    assert _is_mp3(whole.content) and whole.response.headers["x-finish-reason"]


@pytest.mark.parametrize("client, body, fmt", [
    # Open WebUI: the browser's {input, voice}, the backend adds its configured model; it saves the body as .mp3
    ("open-webui", {"input": "Hello from Open WebUI.", "voice": "alloy", "model": "tts-1"}, "mp3"),
    # LiteLLM proxy: the openai SDK's body; optional params pass through
    ("litellm", {"model": "tts-1-hd", "input": "Hello from LiteLLM.", "voice": "echo"}, "mp3"),
    ("litellm", {"model": "gpt-4o-mini-tts", "input": "Hi.", "voice": "coral", "instructions": "Cheerfully.",
                 "response_format": "wav", "speed": 1.25}, "wav"),
    # Home Assistant (openai_tts integration): whole mp3, and its streaming opus call
    ("home-assistant", {"model": "tts-1", "input": "The door is open.", "voice": "nova", "response_format": "mp3",
                        "speed": 1.0, "instructions": "Calm and clear."}, "mp3"),
    ("home-assistant", {"model": "tts-1", "input": "The door is open.", "voice": "shimmer", "response_format": "opus",
                        "speed": 1.0}, "opus"),
])
def test_client_request_bodies_unchanged(http, client, body, fmt):
    r = http.post("/v1/audio/speech", json=body, headers={**_auth(ALICE), "User-Agent": client})
    assert r.status_code == 200, r.text[:300]
    assert decode(r.content, fmt)[0].size > 0


def test_models_by_id_and_openai_names(http):
    listed = http.get("/v1/models", headers=_auth(BOB)).json()["data"]
    assert [m["id"] for m in listed] == ["cv", "base", "fake"] and "tts-1" in listed[0]["aliases"]
    assert http.get("/v1/models/tts-1-hd", headers=_auth(BOB)).json()["id"] == "cv"
    assert http.get("/v1/models/base", headers=_auth(BOB)).json()["object"] == "model"
    _error(http.get("/v1/models/nothing", headers=_auth(BOB)), 404, "model_not_found")
    voices = http.get("/v1/audio/voices", headers=_auth(BOB)).json()
    assert voices["voice_aliases"]["onyx"] == "uncle_fu"


# ------------------------------------------------------------------ keys on HTTP
def test_http_keys_missing_wrong_scope_right_and_open_paths(http):
    body = {"model": "tts-1", "input": "Hi.", "voice": "alloy"}
    missing = http.post("/v1/audio/speech", json=body)
    wrong = http.post("/v1/audio/speech", json=body, headers=_auth("sk-alice-1112"))
    assert _error(missing, 401, "invalid_api_key") == _error(wrong, 401, "invalid_api_key")
    _error(http.post("/v1/audio/speech", json=body, headers=_auth(UPLOADER)), 403, "insufficient_scope")
    _error(http.delete("/v1/audio/voices/x", headers=_auth(ONE_STREAM)), 403, "insufficient_scope")
    _error(http.get("/v1/audio/voices"), 401)
    assert http.post("/v1/audio/speech", json=body, headers=_auth(ADMIN)).status_code == 200
    assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200


def test_a_key_added_to_the_file_works_on_every_replica_without_a_restart(http, keys_file):
    body = {"model": "tts-1", "input": "Hi.", "voice": "ash", "response_format": "pcm"}
    new = "sk-added-7777"
    _error(http.post("/v1/audio/speech", json=body, headers=_auth(new)), 401)
    keys_file.write_text(KEYS + f"{new} speech\n")
    try:
        wait_for(lambda: http.post("/v1/audio/speech", json=body, headers=_auth(new)).status_code == 200, 60,
                 message="the new key accepted")
        for _ in range(6):  # whichever replica answers
            assert http.post("/v1/audio/speech", json=body, headers=_auth(new)).status_code == 200
    finally:
        keys_file.write_text(KEYS)
    wait_for(lambda: http.post("/v1/audio/speech", json=body, headers=_auth(new)).status_code == 401, 60,
             message="the removed key refused")


# ------------------------------------------------------------------ keys on the WebSocket
def _socket(app: str, key: str | None = None, query: str = ""):
    from websockets.sync.client import connect

    url = app.replace("http://", "ws://") + "/v1/audio/speech/stream" + query
    return connect(url, max_size=None, additional_headers=_auth(key) if key else None).__enter__()


def _speak_one(ws) -> dict:
    """One utterance on `ws`, which it closes (an open socket would hold the app's deletion for its idle timeout)."""
    try:
        ws.send(json.dumps({"type": "open", "context_id": "c", "model": "cv", "voice": "nova", "input": "Hi there.",
                            "max_new_tokens": 4, "suppress_eos": True}))
        ws.send(json.dumps({"type": "end", "context_id": "c"}))
        while True:
            message = ws.recv(timeout=120)
            if isinstance(message, str) and json.loads(message)["type"] in ("done", "error"):
                return json.loads(message)
    finally:
        ws.close()


def test_websocket_keys_by_header_query_or_first_message(app):
    from websockets.exceptions import ConnectionClosed

    assert _speak_one(_socket(app, ALICE))["type"] == "done"
    assert _speak_one(_socket(app, query=f"?api_key={BOB}"))["type"] == "done"
    ws = _socket(app)
    ws.send(json.dumps({"type": "auth", "api_key": ADMIN}))
    assert json.loads(ws.recv(timeout=60)) == {"type": "authenticated"}
    assert _speak_one(ws)["type"] == "done"
    for key, query, status in ((None, "?api_key=sk-wrong", 401), (UPLOADER, "", 403), (None, "", 401)):
        ws = _socket(app, key, query)
        if not key and not query:
            ws.send(json.dumps({"type": "open", "context_id": "c", "input": "no auth message first"}))
        error = json.loads(ws.recv(timeout=60))
        assert error["type"] == "error" and error["status"] == status and error["final"], error
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=60)
        assert ws.close_code == 1008


# ------------------------------------------------------------------ ownership
def _upload(http, key: str, name: str, clip: bytes = None, filename: str = "a.wav", **fields) -> httpx.Response:
    return http.post("/v1/audio/voices", headers=_auth(key), data={"name": name, **fields},
                     files={"audio_sample": (filename, clip or wav_bytes(1.5), "application/octet-stream")})


def test_a_voice_belongs_to_the_key_that_uploaded_it(http):
    r = _upload(http, ALICE, "AliceVoice", consent="cons_alice_1")
    assert r.status_code == 200, r.text
    voice = r.json()
    assert voice["object"] == "audio.voice" and voice["id"] == voice["name"] == "AliceVoice"
    assert voice["consent"] == "cons_alice_1" and voice["created_at"] > 0
    speak = {"model": "base", "input": "Mine.", "voice": "alicevoice", "response_format": "pcm"}
    assert http.post("/v1/audio/speech", json=speak, headers=_auth(ALICE)).status_code == 200
    # bob cannot see, use, overwrite or delete it (any case of its name)
    def names(key):
        return {v["name"] for v in http.get("/v1/audio/voices", headers=_auth(key)).json()["uploaded_voices"]}
    assert "AliceVoice" in names(ALICE) and "AliceVoice" not in names(BOB)
    _error(http.post("/v1/audio/speech", json=speak, headers=_auth(BOB)), 400, "voice_not_found")
    for name in ("AliceVoice", "ALICEVOICE", "alicevoice"):
        _error(http.delete(f"/v1/audio/voices/{name}", headers=_auth(BOB)), 404, "voice_not_found")
    _error(_upload(http, BOB, "alicevoice", replace="true"), 409, "voice_exists")
    # its owner replaces it only when asked; admin sees and deletes it
    _error(_upload(http, ALICE, "AliceVoice"), 409, "voice_exists")
    assert _upload(http, ALICE, "AliceVoice", replace="true").status_code == 200
    assert "AliceVoice" in names(ADMIN)
    assert http.delete("/v1/audio/voices/alicevoice", headers=_auth(ADMIN)).json() == {"success": True,
                                                                                      "name": "AliceVoice"}


@pytest.mark.parametrize("kind", ["webm", "m4a"])
def test_browser_and_phone_recordings_upload_and_speak(http, kind):
    r = _upload(http, ALICE, f"rec-{kind}", recorded_clip(2.0, *RECORDED[kind]), f"clip.{kind}")
    assert r.status_code == 200, r.text
    assert r.json()["voice"]["mime_type"] == "audio/wav"
    speak = {"model": "base", "input": "Recorded.", "voice": f"rec-{kind}", "response_format": "pcm"}
    assert http.post("/v1/audio/speech", json=speak, headers=_auth(ALICE)).status_code == 200
    inline = {"model": "base", "input": "Inline.", "x_vector_only_mode": True, "response_format": "pcm",
              "ref_audio": base64.b64encode(recorded_clip(1.5, *RECORDED[kind], seed=2)).decode()}
    assert http.post("/v1/audio/speech", json=inline, headers=_auth(ALICE)).status_code == 200
    _error(_upload(http, ALICE, f"bad-{kind}", b"\x1a\x45\xdf\xa3" + b"\0" * 500, f"clip.{kind}"), 400)
    assert http.delete(f"/v1/audio/voices/rec-{kind}", headers=_auth(ALICE)).status_code == 200


# ------------------------------------------------------------------ per-key limits across the two replicas
def _counts(key: str) -> dict:
    import ray

    from deployments.ingress.rate_limits import ACTOR_NAMESPACE, ACTOR_PREFIX

    actor = ray.get_actor(ACTOR_PREFIX + APP_NAME, namespace=ACTOR_NAMESPACE)
    return ray.get(actor.counts.remote(key_digest(key).hex()), timeout=30)


def _held_stream(app: str, body: dict, key: str) -> socket.socket:
    """A streaming request on a plain socket, returned once its audio started (the server answers 200 with the first
    audio): closing the socket is the client leaving."""
    url = urlsplit(app)
    sock = socket.create_connection((url.hostname, url.port), timeout=120)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {url.path}/v1/audio/speech HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    head = b""
    while b"\r\n\r\n" not in head:
        piece = sock.recv(65536)
        assert piece, head
        head += piece
    assert b" 200 " in head.split(b"\r\n")[0], head[:300]
    return sock


def test_a_keys_stream_limit_holds_across_ingress_replicas(app, http):
    # a stream of the fake engine that plays 4 frames and then waits: its key's one slot stays taken
    held = _held_stream(app, {"model": "fake", "input": "Paused.", "voice": "vivian", "seed": PAUSE_SEED,
                              "response_format": "pcm", "max_new_tokens": 50}, ONE_STREAM)
    try:
        assert _counts(ONE_STREAM)["streams"] == 1
        quick = {"model": "tts-1", "input": "Hi.", "voice": "alloy", "response_format": "pcm"}
        for _ in range(6):  # both replicas are asked (Serve spreads requests): each refuses
            refused = http.post("/v1/audio/speech", json=quick, headers=_auth(ONE_STREAM))
            _error(refused, 429, "rate_limit_exceeded")
            assert int(refused.headers["retry-after"]) >= 1
    finally:
        held.shutdown(socket.SHUT_RDWR)
        held.close()
    # the paused stream ends when its client leaves: its slot comes back
    wait_for(lambda: _counts(ONE_STREAM)["streams"] == 0, 120, 0.5, "the slot released")
    ok = http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": "alloy",
                                             "response_format": "pcm"}, headers=_auth(ONE_STREAM))
    assert ok.status_code == 200, ok.text[:300]


def test_a_keys_rate_holds_across_ingress_replicas(http):
    quick = {"model": "tts-1", "input": "Hi.", "voice": "sage", "response_format": "pcm", "stream": False}
    answers = [http.post("/v1/audio/speech", json=quick, headers=_auth(THREE_A_MINUTE)) for _ in range(7)]
    assert [r.status_code for r in answers] == [200] * 3 + [429] * 4
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in answers[3:])
    assert _counts(THREE_A_MINUTE)["recent_starts"] == 3
    assert http.post("/v1/audio/speech", json=quick, headers=_auth(BOB)).status_code == 200  # others go on


# ------------------------------------------------------------------ hostile requests with auth on
HOSTILE_HEADERS = [{}, {"Authorization": "Bearer"}, {"Authorization": "Bearer " + "x" * 60_000},
                   {"Authorization": "Basic YWxpY2U6cHc="}, {"Authorization": b"Bearer \xff\xfe"},
                   {"Authorization": f"Bearer {ALICE} extra"}, {"Authorization": f"bearer   {ALICE}"}]


def test_hostile_requests_with_auth_on_are_never_5xx(http):
    bodies = [{"model": "tts-1", "input": "x", "voice": "alloy", "top_k": 2**64},
              {"model": "tts-1", "input": "a\ud800b".encode("utf-8", "surrogatepass").decode("latin-1"), "voice": "x"},
              {"model": "m" * 100_000, "input": "x"}, {"input": "x", "instructions": "i" * 5000}, [], "null", 7]
    for headers in HOSTILE_HEADERS:
        for body in bodies:
            r = http.post("/v1/audio/speech", content=json.dumps(body).encode(),
                          headers={**headers, "content-type": "application/json"})
            assert r.status_code < 500, (str(headers.get("Authorization", ""))[:30], r.status_code, r.text[:200])
        for method, path in (("GET", "/v1/audio/voices"), ("DELETE", "/v1/audio/voices/..%2F..%2Fetc"),
                             ("GET", "/v1/models/%00"), ("POST", "/v1/audio/voices")):
            assert http.request(method, path, headers=headers).status_code < 500
    r = http.post("/v1/audio/speech", headers=_auth(ALICE),
                  json={"model": "tts-1", "input": "x", "voice": "alloy", "instructions": "i" * 4097})
    assert _error(r, 400)["param"] == "instructions"
