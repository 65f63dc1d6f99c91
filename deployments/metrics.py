"""Every metric the application exports, defined once (Prometheus names get a `ray_` prefix).

`ray.serve.metrics` adds the deployment/replica/application tags. Metric objects are built in the
replica that records them (`IngressMetrics()` in the ingress constructor, etc.).
"""

from __future__ import annotations

from ray.serve import metrics

LATENCY_MS_BUCKETS = [5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800]
# first audio is 15-60 ms served on a GPU: fine buckets there, so that its quantiles are not a bucket's width
FIRST_AUDIO_MS_BUCKETS = [5, 10, 15, 20, 30, 40, 50, 75, 100, 150, 200, 400, 800, 1600, 3200, 6400, 12800]
RTF_BUCKETS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128]
ALIGNER_COST_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]


class IngressMetrics:
    def __init__(self) -> None:
        self.requests = metrics.Counter(
            "tts_requests", description="Speech requests by final status (ok, bad_request, not_found, rejected, "
            "cancelled, timeout, error).", tag_keys=("model", "status", "stream"),
        )
        self.rejections = metrics.Counter(
            "tts_rejections", description="Requests refused at capacity, by the limit that refused them "
            "(ingress_open_requests, serve_queue, engine_queue: deployments/errors.OVERLOAD_LIMITS).",
            tag_keys=("model", "limit"),
        )
        self.time_to_first_audio_ms = metrics.Histogram(
            "tts_time_to_first_audio_ms", description="Request arrival to the first audio byte handed to the client.",
            boundaries=FIRST_AUDIO_MS_BUCKETS, tag_keys=("model", "stream"),
        )
        self.first_audio_stage_ms = metrics.Histogram(
            "tts_first_audio_stage_ms", description="Each hop of a request's first audio (stage: ingress, "
            "to_talker, talker_queue, talker, talker_decode, to_ingress, to_code2wav, code2wav_queue, code2wav, "
            "from_code2wav, respond, total; the Server-Timing header of the response, deployments/first_audio_timing.py).",
            boundaries=[0.5, 1, 2, *FIRST_AUDIO_MS_BUCKETS], tag_keys=("model", "stage"),
        )
        self.real_time_factor = metrics.Histogram(
            "tts_real_time_factor", description="Wall time of a request divided by the duration of its audio.",
            boundaries=RTF_BUCKETS, tag_keys=("model",),
        )
        self.audio_seconds = metrics.Counter(
            "tts_audio_seconds", description="Seconds of audio produced.", tag_keys=("model",),
        )
        self.client_buffer_lead_s = metrics.Histogram(
            "tts_client_buffer_lead_s", description="Per stream, the smallest lead of audio sent over real-time "
            "playback from the first byte (0 when the listener heard a gap; see tts_client_underruns).",
            boundaries=[0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0], tag_keys=("model",),
        )
        self.client_underruns = metrics.Counter(
            "tts_client_underruns", description="Gaps a real-time player starting at the first byte would hear.",
            tag_keys=("model",),
        )
        self.client_dry_streams = metrics.Counter(
            "tts_client_dry_streams", description="Streams whose real-time player would have run dry at least once "
            "(one or more tts_client_underruns); over the count of tts_client_buffer_lead_s, the share of streams.",
            tag_keys=("model",),
        )
        self.client_underrun_seconds = metrics.Counter(
            "tts_client_underrun_seconds", description="Seconds of such gaps.", tag_keys=("model",),
        )
        self.frame_cap_cuts = metrics.Counter(
            "tts_frame_cap_cuts", description="Talker requests (a long input's pieces included) that reached their "
            "frame cap without EOS when the client set no cap of its own: their speech was cut.", tag_keys=("model",),
        )
        self.open_streams = metrics.Gauge(
            "tts_open_streams", description="Requests being generated right now in this ingress replica.",
            tag_keys=("model",),
        )


class BatchMetrics:
    def __init__(self) -> None:
        self.items = metrics.Gauge(
            "tts_batch_items", description="Items of every batch job in the store by state (queued, running, "
            "completed, failed, cancelled); each ingress replica reports the same store-wide counts: aggregate "
            "with max, not sum.", tag_keys=("state",),
        )

    def record(self, counts: dict[str, int]) -> None:
        for state, count in counts.items():
            self.items.set(count, tags={"state": state})


class TalkerMetrics:
    def __init__(self, model: str) -> None:
        tags = ("model",)
        self.waiting = metrics.Gauge("tts_talker_waiting", description="Requests waiting for an engine slot.",
                                     tag_keys=tags)
        self.running = metrics.Gauge("tts_talker_running", description="Requests in engine slots (live-text ones "
                                     "waiting for text included: they keep their slot).", tag_keys=tags)
        self.waiting_for_text = metrics.Gauge(
            "tts_talker_waiting_for_text", description="Live-text requests (WebSocket contexts) waiting for their "
            "client's next text: in a slot without stepping, or not yet prefilled.", tag_keys=tags)
        self.slots = metrics.Gauge("tts_talker_slots", description="Engine slots (max running requests).",
                                   tag_keys=tags)
        self.kv_usage = metrics.Gauge("tts_talker_kv_usage", description="Fraction of KV-cache positions reserved.",
                                      tag_keys=tags)
        self.frames = metrics.Counter("tts_talker_frames", description="Codec frames generated (80 ms each).",
                                      tag_keys=tags)
        self.mean_batch_size = metrics.Histogram(
            "tts_talker_mean_batch_size", description="Running requests per decode step, averaged over each "
            "stats refresh (one observation per refresh, not per step).",
            boundaries=BATCH_BUCKETS, tag_keys=tags,
        )
        for metric in (self.waiting, self.running, self.waiting_for_text, self.slots, self.kv_usage, self.frames,
                       self.mean_batch_size):
            metric.set_default_tags({"model": model})


class Code2WavMetrics:
    def __init__(self) -> None:
        self.call_latency_ms = metrics.Histogram(
            "tts_code2wav_call_latency_ms", description="Arrival of a decode_many call (the chunks of many streams) "
            "to its answer: wait for the decoder + decode; one observation per call.",
            boundaries=LATENCY_MS_BUCKETS,
        )
        self.batch_decode_ms = metrics.Histogram(
            "tts_code2wav_batch_decode_ms", description="Decode time of one batch of chunks.",
            boundaries=LATENCY_MS_BUCKETS,
        )
        self.batch_size = metrics.Histogram(
            "tts_code2wav_batch_size", description="Chunks decoded together.", boundaries=BATCH_BUCKETS,
        )
        self.queued_chunks = metrics.Gauge(
            "tts_code2wav_queued_chunks", description="Chunks waiting for a decode batch in this replica.",
        )
        self.state_chunks = metrics.Counter(
            "tts_code2wav_state_chunks", description="Stateful engine: chunks decoded from their stream's carried "
            "state (path=continued) or from zero state over their left context (path=fresh: first chunks, and "
            "chunks whose stream state another replica holds or that was evicted).", tag_keys=("path",),
        )
        self._state_counts = {"continued": 0, "fresh": 0}
        self.named_chunks = metrics.Counter(
            "tts_code2wav_named_chunks", description="Stream affinity: chunks of decode calls that named a replica "
            "(the one holding their streams' state), by where they landed: landed=here, or landed=elsewhere when "
            "the named replica was full or gone (deployments/ingress/placement.py).", tag_keys=("landed",),
        )

    def record_state_paths(self, stats) -> None:
        """Count the chunks each path took since the last call (from the engine's cumulative Code2WavStats)."""
        for path in ("continued", "fresh"):
            total = getattr(stats, path, 0)
            if total > self._state_counts[path]:
                self.state_chunks.inc(total - self._state_counts[path], tags={"path": path})
                self._state_counts[path] = total


class AlignerMetrics:
    def __init__(self) -> None:
        self.batch_size = metrics.Histogram(
            "tts_aligner_batch_size", description="Pieces of audio timed in one aligner forward.",
            boundaries=BATCH_BUCKETS,
        )
        self.seconds_per_audio_second = metrics.Histogram(
            "tts_aligner_seconds_per_audio_second", description="Wall seconds of one aligner forward per second of "
            "audio it timed (its cost beside the speech it times).", boundaries=ALIGNER_COST_BUCKETS,
        )
        self.call_latency_ms = metrics.Histogram(
            "tts_aligner_call_latency_ms", description="Arrival of an align call to its answer: wait for the "
            "aligner + forward.", boundaries=LATENCY_MS_BUCKETS,
        )
