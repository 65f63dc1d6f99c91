"""One in-process Ray Serve cluster for the tests of this package, serving the tiny checkpoints through the real app.
It stops once they have run: idle, the app's replicas and Ray's own processes keep ~40% of a core busy, which the
tests after them (tests/stages) would pay for.

Logical resources are oversubscribed (`num_cpus=8`, replicas ask for 0 CPUs) so that the whole app
schedules on a 2-core machine. Token auth is off and set through the environment, so the cluster is
self-contained (Ray >= 2.59 would otherwise write ~/.ray/auth_token and turn auth on for later clusters).
"""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import soundfile as sf

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# custom autoscaling metrics reach the controller fast enough for a test
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.conftest import reference_clip

APP = "tts"
ZERO_CPU = {"ray_actor_options": {"num_cpus": 0}}
STALL_SEED = 666  # a request with this seed stops the `fake` model's engine (tests/fake_engine.py)
PAUSE_SEED = 777  # a request with this seed gets 4 frames from the `fake` engine, then waits forever
BODY_READ_TIMEOUT_S = 5.0  # the test app's: half-sent bodies are answered 408 this long after they arrived


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.1, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {message}")


def wav_bytes(seconds: float = 2.0, seed: int = 0) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, reference_clip(seconds, seed=seed), 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture(scope="package")
def ray_cluster():
    import ray
    from ray import serve

    # replica logs are noisy; QWEN3_TTS_TEST_RAY_LOGS=1 shows them (they are always in /tmp/ray/session_latest/logs)
    metrics_port = free_port()
    ray.init(num_cpus=8, include_dashboard=False, _metrics_export_port=metrics_port,
             log_to_driver=os.environ.get("QWEN3_TTS_TEST_RAY_LOGS") == "1")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    os.environ["QWEN3_TTS_TEST_METRICS_URL"] = f"http://127.0.0.1:{metrics_port}/metrics"
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="package")
def file_server(tmp_path_factory):
    """A local http server: `/allowed/...` is on the app's ref_audio allowlist, `/other/...` is not."""
    root = tmp_path_factory.mktemp("files")
    for sub in ("allowed", "other"):
        (root / sub).mkdir()
        (root / sub / "clip.wav").write_bytes(wav_bytes(1.5, seed=3))
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def app_args(tiny_custom_voice, tiny_base, tiny_voice_design, voices_dir, allowed_prefix, aligner=None) -> dict:
    """`aligner`: a tiny aligner checkpoint: the app serves word timestamps (tests/serve/test_timestamps.py)."""
    def model(name, path, slots, **extra):
        return {"name": name, "model": str(path), "device": "cpu", "cpu_threads": 1,
                "engine_kwargs": {"max_num_seqs": slots, "max_seq_len": 512},
                "deployment_config": {**ZERO_CPU, **extra.pop("deployment", {})}, **extra}

    return {
        "models": [
            # cv's Talker decodes first chunks itself (deployments/talker/first_chunk_decoder.py) while <= 8 requests run
            model("cv", tiny_custom_voice, 20, aliases=["tts-1"], first_chunk_decode_max_running=8),
            model("base", tiny_base, 4),
            # one slot, one request open, one more waiting at the ingress
            model("vd", tiny_voice_design, 1, deployment={"max_ongoing_requests": 1, "max_queued_requests": 1}),
            # the autoscaling test's model: the fake engine (paused streams hold the load for as long as the test
            # needs), one slot per replica, scales 1 -> 2 -> 1 on queue depth. Serve averages the replicas' metrics
            # over `look_back_period_s`, which must exceed `metrics_interval_s` (10 s, the deprecated field's default)
            {**model("cv-scale", tiny_custom_voice, 1, deployment={
                "max_ongoing_requests": 2, "max_queued_requests": 8,
                "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                       "upscale_delay_s": 0.5, "downscale_delay_s": 1, "look_back_period_s": 10.5}}),
             "engine_cls": "tests.fake_engine:FakeTalkerEngine",
             "engine_kwargs": {"max_num_seqs": 1, "max_seq_len": 512, "pause_seed": PAUSE_SEED, "pause_after_frames": 4}},
            # a fake engine (tests/fake_engine.py) whose faults requests inject: health checks every second; a
            # heartbeat stale for 3 s fails them (the stall test's), not a loaded machine's scheduling of its loop
            # 2 streams open, 1 more waiting at the ingress: the 429 test (test_errors.py) fills it with paused streams
            {**model("fake", tiny_custom_voice, 2, deployment={"health_check_period_s": 1,
                                                               "health_check_timeout_s": 5,
                                                               "max_ongoing_requests": 2, "max_queued_requests": 1}),
             "engine_cls": "tests.fake_engine:FakeTalkerEngine",
             "engine_kwargs": {"max_num_seqs": 2, "max_seq_len": 512, "stall_seed": STALL_SEED,
                               "stall_timeout_s": 3.0, "pause_seed": PAUSE_SEED, "pause_after_frames": 4}},
        ],
        # production-like: the serving defaults (stateful Code2Wav, batch fill, one-frame first chunk, the Talkers'
        # first-chunk decoders), with CPU sizes
        "code2wav": {"device": "cpu", "cpu_threads": 1, "max_batch_size": 16, "deployment_config": ZERO_CPU},
        **({"aligner": {"model": str(aligner), "device": "cpu", "cpu_threads": 1, "deployment_config": ZERO_CPU}}
           if aligner is not None else {}),
        "streaming": {"steady_chunk_frames": 8, "left_context_frames": 4},
        "ingress": {
            "voices_dir": str(voices_dir), "batch": {"store_dir": str(voices_dir.parent / "batches")},
            "max_input_chars": 300, "max_ref_audio_bytes": 300_000,
            "max_ref_audio_seconds": 5.0, "request_timeout_s": 120, "max_request_bytes": 1_000_000,
            "ref_audio_url_allowlist": [allowed_prefix], "body_read_timeout_s": BODY_READ_TIMEOUT_S,
            "allow_suppress_eos": True,
            "default_response_format": "wav",  # these tests read WAV unless they ask (the OpenAI default, mp3:
                                               # tests/serve/test_openai_auth.py)
            "deployment_config": {**ZERO_CPU, "num_replicas": 1},  # one event loop on CPU
        },
    }


@pytest.fixture(scope="package")
def serve_app(ray_cluster, file_server, tiny_custom_voice, tiny_base, tiny_voice_design, tmp_path_factory):
    """The app deployed once; -> (base URL, args dict)."""
    from ray import serve

    from deployments.builder import build_app
    from stages.aligner.random_checkpoint import write_random_aligner

    aligner = write_random_aligner(tmp_path_factory.mktemp("aligner"), tiny=True, dtype="float32", log=lambda *_: None)
    args = app_args(tiny_custom_voice, tiny_base, tiny_voice_design, tmp_path_factory.mktemp("voices"),
                    f"{file_server}/allowed/", aligner)
    serve.run(build_app(args), name=APP, route_prefix="/")
    import httpx

    wait_for(lambda: httpx.get(f"{ray_cluster}/ready", timeout=10).status_code == 200, 120, 0.5, "/ready")
    # cv's first-chunk decoder is built after its replica is ready: the tests of where first audio goes need it
    built = serve.get_deployment_handle("Talker:cv", app_name=APP).first_chunk_decoder_built.remote()
    assert built.result(timeout_s=120) is True
    return ray_cluster, args


@pytest.fixture(scope="package")
def base_url(serve_app) -> str:
    return serve_app[0]


@pytest.fixture
def http(base_url):
    import httpx

    with httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


@pytest.fixture
def openai_client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def talker_handle(model: str):
    from ray import serve

    return serve.get_deployment_handle(f"Talker:{model}", app_name=APP)


def engine_stats(model: str) -> dict:
    return talker_handle(model).engine_stats.remote().result(timeout_s=30)


def code2wav_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Code2Wav", app_name=APP).engine_stats.remote().result(timeout_s=30)


def speech(**fields) -> dict:
    """A request body that always terminates on random weights: fixed length, no EOS."""
    return {"model": "cv", "input": "Hello from the tests.", "voice": "vivian", "max_new_tokens": 6,
            "suppress_eos": True, "seed": 1234, **fields}


def replica_pids(deployment: str, app: str = APP) -> list[int]:
    """PIDs of this session's live replica processes of `deployment` (e.g. "TTSIngress", "Talker:cv") in `app`.

    Ray titles replica workers `ray::ServeReplica:<app>:<deployment>[.<method>]`; only descendants of this test
    process count (other Ray clusters may run on the machine).
    """
    me, pids = os.getpid(), []
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        name = cmdline.split(b"\0")[0].split(b" ")[0]  # `ray::<actor>` idle, `ray::<actor>.<method>` busy
        if (name == title or name.startswith(title + b".")) and _descends_from(int(entry), me):
            pids.append(int(entry))
    return pids


def replica_logs(prefix: str) -> dict[str, str]:
    """This session's Serve replica logs of deployments whose name starts with `prefix`: path -> text."""
    from pathlib import Path

    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path()) / "serve"  # no public accessor
    return {str(p): p.read_text(errors="replace") for p in logs.glob(f"replica_tts_{prefix}*.log")}


def logged_since(before: dict[str, str], prefix: str) -> str:
    """What the replica logs of `prefix` gained since `before` (a `replica_logs` result)."""
    return "".join(text[len(before.get(path, "")):] for path, text in replica_logs(prefix).items())


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
    return False


@dataclass
class ClientStream:
    """One streaming speech request, read to its end in a thread: what its client saw, and when it ended.

    Raw streams count audio bytes; SSE streams (`stream_format: "sse"` in the body) also keep their events."""

    url: str
    body: dict
    started: threading.Event = field(default_factory=threading.Event)  # audio in hand, or the request ended
    done: threading.Event = field(default_factory=threading.Event)
    received: int = 0  # audio bytes
    events: list = field(default_factory=list)  # SSE events; the error body of a non-200 answer
    status: int | None = None
    error: BaseException | None = None  # what the client raised (raw: a cut-off stream is RemoteProtocolError)
    ended_at: float | None = None  # time.monotonic() when the client saw the end
    read_timeout_s: float = 120.0  # the longest silence the client takes (a replica restarting: longer)

    @property
    def sse(self) -> bool:
        return self.body.get("stream_format") == "sse"

    def start(self) -> ClientStream:
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        import httpx

        try:
            with httpx.stream("POST", f"{self.url}/v1/audio/speech", json=self.body, timeout=self.read_timeout_s) as r:
                self.status = r.status_code
                if r.status_code != 200:
                    self.events.append(r.read().decode(errors="replace")[:500])
                elif self.sse:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            event = json.loads(line[6:])
                            self.events.append(event)
                            if event["type"] == "speech.audio.delta":
                                self.received += len(event["audio"]) * 3 // 4
                                self.started.set()
                else:
                    for data in r.iter_bytes():
                        self.received += len(data)
                        self.started.set()
        except BaseException as e:  # what the client sees is the tests' subject
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()


def open_streams(url: str, bodies: list[dict], timeout: float = 60) -> list[ClientStream]:
    """Start one ClientStream per body; return once each has audio in hand (mid-stream for sure). `timeout`
    bounds that wait and each stream's silences (at least 120 s)."""
    streams = [ClientStream(url, body, read_timeout_s=max(120.0, timeout)).start() for body in bodies]
    for s in streams:
        assert s.started.wait(timeout), "no audio in time"
        assert s.error is None and s.status == 200 and not s.done.is_set(), (s.status, s.error, s.events[-1:])
    return streams


def pcm_of(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2")
