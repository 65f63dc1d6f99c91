"""Defaults of the Serve layer, each overridable through an environment variable of the same name."""

from __future__ import annotations

import os
from pathlib import Path


def _env_number(name: str, default, kind: type):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not {'an integer' if kind is int else 'a number'}"
                         ) from None
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r} must not be negative")
    return value


def _env_int(name: str, default: int) -> int:
    return _env_number(name, default, int)


def _env_float(name: str, default: float) -> float:
    return _env_number(name, default, float)


def _env_path(name: str, default: Path) -> Path:
    return Path(os.environ.get(name, str(default))).expanduser()


# where the embedded tiny checkpoints and uploaded voices live by default
QWEN3_TTS_SERVE_HOME = _env_path("QWEN3_TTS_SERVE_HOME", Path.home() / ".cache" / "qwen3-tts-serve")
EMBEDDED_CHECKPOINT_DIR = QWEN3_TTS_SERVE_HOME / "embedded"
DEFAULT_VOICES_DIR = QWEN3_TTS_SERVE_HOME / "voices"
DEFAULT_BATCH_STORE_DIR = QWEN3_TTS_SERVE_HOME / "batches"
# torch.compile's cache file (stages/compile_cache.py): on shared storage, one start compiles for every replica
COMPILE_CACHE_DIR = _env_path("QWEN3_TTS_COMPILE_CACHE_DIR", QWEN3_TTS_SERVE_HOME / "compile")
# Triton's cache for the replicas (unless TRITON_CACHE_DIR is set): the project's own kernels (paged attention,
# the vocoder's) compile per shape family on first use; beside the compile cache, a start from it compiles none
TRITON_CACHE_DIR = COMPILE_CACHE_DIR / "triton"
# Python bytecode of what a GPU replica imports (torch, Triton, sympy...) where the installed packages carry none
# (deployments/loading.keep_bytecode); QWEN3_TTS_PYCACHE_DIR=off leaves Python's own choice alone
PYCACHE_DIR = os.environ.get("QWEN3_TTS_PYCACHE_DIR", str(COMPILE_CACHE_DIR / "pycache"))

# deployment names (YAML `deployments:` overrides must use these)
INGRESS_DEPLOYMENT_NAME = "TTSIngress"
TALKER_DEPLOYMENT_PREFIX = "Talker:"
CODE2WAV_DEPLOYMENT_NAME = "Code2Wav"
CODE2WAV_REQUEST_ROUTER = "deployments.code2wav.router:StreamAffinityRouter"  # Code2Wav's (stream affinity)
ALIGNER_DEPLOYMENT_NAME = "Aligner"

# Talker: Serve admission (its engine rows, `engine_kwargs.max_num_seqs`, default to the engine config's)
# open streams a replica accepts per engine slot (the excess waits inside the engine, ready to be admitted
# the step a slot frees) and requests queued at the caller per slot before a fast 429/503
TALKER_ONGOING_PER_SLOT = _env_float("QWEN3_TTS_TALKER_ONGOING_PER_SLOT", 1.5)
TALKER_QUEUED_PER_SLOT = _env_float("QWEN3_TTS_TALKER_QUEUED_PER_SLOT", 1.0)
# Serve's call bound of a Talker replica per speech request it holds open (`TalkerDeploymentConfig.max_ongoing_calls`)
TALKER_CALLS_PER_ONGOING_REQUEST = 2
TALKER_GRACEFUL_SHUTDOWN_TIMEOUT_S = _env_float("QWEN3_TTS_TALKER_GRACEFUL_SHUTDOWN_TIMEOUT_S", 120.0)
# requests (speech, or live WebSocket contexts) an ingress replica sends to a Talker in one call
# (deployments/ingress/talker_calls.py): a bound, as Serve's router balances calls, not the requests in them; and
# how long a batch's admission may hold the next batch (a slow replica must not hold every request behind it)
TALKER_CALL_MAX_BATCH = _env_int("QWEN3_TTS_TALKER_CALL_MAX_BATCH", 32)
TALKER_CALL_ADMISSION_WAIT_S = _env_float("QWEN3_TTS_TALKER_CALL_ADMISSION_WAIT_S", 0.05)
# a speech request a full Talker replica refused goes again in a batch this much later (Serve may route it elsewhere)
TALKER_CALL_RETRY_AFTER_S = _env_float("QWEN3_TTS_TALKER_CALL_RETRY_AFTER_S", 0.02)
# the ingress's default graceful_shutdown_timeout_s is the Talkers' longest plus this: when both stop together
# (the app deleted or redeployed) the Talker's remaining streams end first, while the ingress can still say so
INGRESS_GRACEFUL_SHUTDOWN_MARGIN_S = _env_float("QWEN3_TTS_INGRESS_GRACEFUL_SHUTDOWN_MARGIN_S", 10.0)
TALKER_ENGINE_START_TIMEOUT_S = _env_float("QWEN3_TTS_TALKER_ENGINE_START_TIMEOUT_S", 1800.0)
WARMUP_FRAMES = _env_int("QWEN3_TTS_WARMUP_FRAMES", 4)

# Code2Wav: dynamic batching of chunks from many streams (`code2wav.max_batch_size`: the engine config's default)
CODE2WAV_ONGOING_PER_BATCH_SLOT = _env_int("QWEN3_TTS_CODE2WAV_ONGOING_PER_BATCH_SLOT", 4)
DEFAULT_CODE2WAV_MAX_QUEUED_REQUESTS = _env_int("QWEN3_TTS_CODE2WAV_MAX_QUEUED_REQUESTS", 1024)
# a batch decodes in milliseconds on a GPU and in well under a second on CPU; a minute means stuck
CODE2WAV_STALL_TIMEOUT_S = _env_float("QWEN3_TTS_CODE2WAV_STALL_TIMEOUT_S", 60.0)
# an ingress's decode call unanswered this long checks (every as long) that Code2Wav was not deleted
CODE2WAV_CALL_PROBE_INTERVAL_S = _env_float("QWEN3_TTS_CODE2WAV_CALL_PROBE_INTERVAL_S", 2.0)

# Aligner: align() calls (one piece each) a replica takes per batch slot, and calls queued at the caller before a
# fast 503; a forward of a full batch takes well under a second on a GPU and seconds on CPU: minutes mean stuck
ALIGNER_ONGOING_PER_BATCH_SLOT = _env_int("QWEN3_TTS_ALIGNER_ONGOING_PER_BATCH_SLOT", 4)
DEFAULT_ALIGNER_MAX_QUEUED_REQUESTS = _env_int("QWEN3_TTS_ALIGNER_MAX_QUEUED_REQUESTS", 1024)
# threads that prepare pieces (resample, normalize, tokenize) as they arrive, beside the device thread's forwards
ALIGNER_PREPARE_THREADS = _env_int("QWEN3_TTS_ALIGNER_PREPARE_THREADS", 2)
ALIGNER_STALL_TIMEOUT_S = _env_float("QWEN3_TTS_ALIGNER_STALL_TIMEOUT_S", 300.0)
ALIGNER_SLOW_FORWARD_S = 1.0  # a forward this long (or one that captured graphs) is logged with what it held
# words of one piece: its prompt holds each word's tokens and two timestamp slots (bounds a forward's length); a
# piece of the aligner's longest audio (400 s) holds some 1,200 spoken words, 2,400 CJK characters
ALIGNER_MAX_WORDS = _env_int("QWEN3_TTS_ALIGNER_MAX_WORDS", 4096)

# Ingress: Serve admits many connections (each a cheap coroutine: half-sent bodies, probes, open streams),
# so that /health and /ready never wait behind speech; the ingress admits the costly work itself
# (`ingress.max_open_requests`) and times out bodies that do not arrive (`ingress.body_read_timeout_s`)
DEFAULT_INGRESS_MAX_ONGOING_REQUESTS = _env_int("QWEN3_TTS_INGRESS_MAX_ONGOING_REQUESTS", 4096)
DEFAULT_INGRESS_MAX_QUEUED_REQUESTS = _env_int("QWEN3_TTS_INGRESS_MAX_QUEUED_REQUESTS", 128)
DEFAULT_INGRESS_MAX_OPEN_REQUESTS = _env_int("QWEN3_TTS_INGRESS_MAX_OPEN_REQUESTS", 256)
DEFAULT_BODY_READ_TIMEOUT_S = _env_float("QWEN3_TTS_BODY_READ_TIMEOUT_S", 30.0)
# the ingress's replicas unless a config sets `num_replicas`: several from the first request (one event loop does
# not carry hundreds of streams; docs/serving.md "Hops and transport"), more as connections grow
INGRESS_AUTOSCALING = {"min_replicas": 4, "max_replicas": 8, "target_ongoing_requests": 64}

# request limits
DEFAULT_MAX_CONTEXTS_PER_CONNECTION = _env_int("QWEN3_TTS_MAX_CONTEXTS_PER_CONNECTION", 16)  # WebSocket
# WebSockets: a socket with no open context is closed after this; caps per ingress replica and per client
# address, far below the thousands of sockets that starve a replica's event loop (its probes and HTTP included)
DEFAULT_WEBSOCKET_IDLE_TIMEOUT_S = _env_float("QWEN3_TTS_WEBSOCKET_IDLE_TIMEOUT_S", 30.0)
DEFAULT_MAX_WEBSOCKETS_PER_REPLICA = _env_int("QWEN3_TTS_MAX_WEBSOCKETS_PER_REPLICA", 1024)
DEFAULT_MAX_WEBSOCKETS_PER_CLIENT = _env_int("QWEN3_TTS_MAX_WEBSOCKETS_PER_CLIENT", 64)
# a speech request's input (a long one runs as several Talker requests: a book chapter fits); a reference transcript
DEFAULT_MAX_INPUT_CHARS = _env_int("QWEN3_TTS_MAX_INPUT_CHARS", 100_000)
DEFAULT_MAX_REF_TEXT_CHARS = _env_int("QWEN3_TTS_MAX_REF_TEXT_CHARS", 4096)
DEFAULT_MAX_INSTRUCTIONS_CHARS = _env_int("QWEN3_TTS_MAX_INSTRUCTIONS_CHARS", 4096)  # OpenAI's limit
DEFAULT_MAX_REF_AUDIO_BYTES = _env_int("QWEN3_TTS_MAX_REF_AUDIO_BYTES", 10 * 1024 * 1024)
DEFAULT_MAX_REF_AUDIO_SECONDS = _env_float("QWEN3_TTS_MAX_REF_AUDIO_SECONDS", 60.0)
MIN_REF_AUDIO_SECONDS = _env_float("QWEN3_TTS_MIN_REF_AUDIO_SECONDS", 0.5)  # shorter clips carry no usable voice
MIN_REF_AUDIO_SAMPLE_RATE = _env_int("QWEN3_TTS_MIN_REF_AUDIO_SAMPLE_RATE", 8000)
DEFAULT_MAX_REQUEST_BYTES = _env_int("QWEN3_TTS_MAX_REQUEST_BYTES", 16 * 1024 * 1024)
DEFAULT_MAX_NEW_TOKENS = _env_int("QWEN3_TTS_DEFAULT_MAX_NEW_TOKENS", 2048)
DEFAULT_MIN_FITTED_FRAMES = _env_int("QWEN3_TTS_MIN_FITTED_FRAMES", 25)  # 2 s of audio
DEFAULT_REQUEST_TIMEOUT_S = _env_float("QWEN3_TTS_REQUEST_TIMEOUT_S", 600.0)
DEFAULT_RETRY_AFTER_S = _env_float("QWEN3_TTS_RETRY_AFTER_S", 1.0)
DEFAULT_MAX_UPLOADED_VOICES = _env_int("QWEN3_TTS_MAX_UPLOADED_VOICES", 1000)
INLINE_VOICE_CACHE_SIZE = _env_int("QWEN3_TTS_INLINE_VOICE_CACHE_SIZE", 64)
REF_AUDIO_FETCH_TIMEOUT_S = _env_float("QWEN3_TTS_REF_AUDIO_FETCH_TIMEOUT_S", 10.0)
READY_PROBE_TIMEOUT_S = _env_float("QWEN3_TTS_READY_PROBE_TIMEOUT_S", 2.0)

# an ingress replica's decode calls to Code2Wav: chunks per call, calls in flight (deployments/ingress/decode_batcher.py)
DEFAULT_DECODE_BATCH_MAX_CHUNKS = _env_int("QWEN3_TTS_DECODE_BATCH_MAX_CHUNKS", 64)
DEFAULT_DECODE_CALLS_IN_FLIGHT = _env_int("QWEN3_TTS_DECODE_CALLS_IN_FLIGHT", 4)

# decoded chunks in flight per stream: decodes overlap generation, audio still leaves in order
DEFAULT_MAX_PENDING_DECODES = _env_int("QWEN3_TTS_MAX_PENDING_DECODES", 4)
# a stream's first chunks that its listener waits for: the first, and the second (it must follow within the
# first's audio). Code2Wav's batch never waits to fill with them, and stream affinity never holds them back.
WAITED_FOR_CHUNKS = 2

# batch jobs (deployments/ingress/batch_worker.py): items per job, items in flight per ingress replica, the lease
# of a claimed item, how long a finished job is kept, and how often an idle replica looks for work submitted elsewhere.
# Items in flight: 2 per replica is what keeps real-time first audio within +10% while a job runs beside it
# (docs/results.md, "Long input and batch jobs"); a deployment for bulk work alone raises it.
DEFAULT_BATCH_MAX_ITEMS = _env_int("QWEN3_TTS_BATCH_MAX_ITEMS", 10000)
DEFAULT_BATCH_ITEMS_IN_FLIGHT = _env_int("QWEN3_TTS_BATCH_ITEMS_IN_FLIGHT", 2)
DEFAULT_BATCH_LEASE_S = _env_float("QWEN3_TTS_BATCH_LEASE_S", 30.0)
DEFAULT_BATCH_RETENTION_S = _env_float("QWEN3_TTS_BATCH_RETENTION_S", 7 * 86400.0)
BATCH_POLL_INTERVAL_S = _env_float("QWEN3_TTS_BATCH_POLL_INTERVAL_S", 1.0)
BATCH_STORE_BUSY_TIMEOUT_S = _env_float("QWEN3_TTS_BATCH_STORE_BUSY_TIMEOUT_S", 10.0)

# how often replicas refresh their queue/KV gauges
METRICS_REFRESH_INTERVAL_S = _env_float("QWEN3_TTS_METRICS_REFRESH_INTERVAL_S", 2.0)

# the voice name a request may give when the model takes no preset voice (openai's client requires one)
DEFAULT_VOICE_NAME = "default"

# API keys (deployments/ingress/api_keys.py): the keys file when `ingress.auth.keys_file` names none
API_KEYS_FILE_ENV = "QWEN3_TTS_API_KEYS_FILE"
DEFAULT_KEY_MAX_CONCURRENT_STREAMS = 32  # per key, across ingress replicas
DEFAULT_KEY_REQUESTS_PER_MINUTE = 600
