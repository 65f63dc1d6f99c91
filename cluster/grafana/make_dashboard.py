"""Writes cluster/grafana/qwen3_tts_dashboard.json:   python cluster/grafana/make_dashboard.py

The dashboard is generated so that panels stay uniform; edit the panel list here and regenerate.
tests/deployments/test_cluster_dashboard.py checks the JSON: every metric of deployments/metrics.py in a
query under its exported Prometheus name (`ray_` prefix, `_total` on counters, `_bucket` on
histograms), every `ray_serve_*` / `ray_node_*` name known to the installed Ray.
"""

import json
from pathlib import Path

OUT = Path(__file__).with_name("qwen3_tts_dashboard.json")

DS = {"type": "prometheus", "uid": "${datasource}"}
APP = 'application=~"$application"'
MODEL = 'model=~"$model"'
RI = "[$__rate_interval]"

panels = []
pid = [0]
y = [0]
x = [0]
row_h = [0]


def next_id():
    pid[0] += 1
    return pid[0]


def row(title):
    if x[0] != 0:
        y[0] += row_h[0]
        x[0] = 0
    panels.append({"type": "row", "title": title, "id": next_id(), "collapsed": False,
                   "gridPos": {"h": 1, "w": 24, "x": 0, "y": y[0]}, "panels": []})
    y[0] += 1
    row_h[0] = 0


def panel(title, description, targets, unit="short", w=8, h=8, min0=True, stack=False):
    if x[0] + w > 24:
        y[0] += row_h[0]
        x[0] = 0
        row_h[0] = 0
    refs = "ABCDEFGHIJ"
    p = {
        "type": "timeseries",
        "title": title,
        "description": description,
        "id": next_id(),
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x[0], "y": y[0]},
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                           "stacking": {"mode": "normal" if stack else "none", "group": "A"}},
                **({"min": 0} if min0 else {}),
            },
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": refs[i], "range": True}
                    for i, (expr, legend) in enumerate(targets)],
    }
    panels.append(p)
    x[0] += w
    row_h[0] = max(row_h[0], h)


def q(p, metric, flt, by):
    return (f"histogram_quantile({p}, sum by (le{', ' + by if by else ''}) "
            f"(rate({metric}_bucket{{{flt}}}{RI})))")


# Ray exports a histogram as bucket counts: its `_sum` is rebuilt from bucket midpoints (Ray's OpenTelemetry
# metric recorder), so a mean from `_sum / _count` is approximate; every mean says so in its legend
APPROX = " (approx.)"


def mean(metric, flt, by):
    b = f"sum by ({by}) " if by else "sum "
    return f"{b}(rate({metric}_sum{{{flt}}}{RI})) / {b}(rate({metric}_count{{{flt}}}{RI}))"


# ------------------------------------------------------------------ requests
row("Requests (TTSIngress)")
panel("Requests by status",
      "Finished speech requests per second by final status (ray_tts_requests_total).",
      [(f"sum by (status) (rate(ray_tts_requests_total{{{APP}, {MODEL}}}{RI}))", "{{status}}")],
      unit="reqps", stack=True)
panel("Failed requests (share)",
      "Share of requests that did not end ok, by status: rejected = 429/503 backpressure, timeout = deadline, "
      "error = server failure, bad_request/not_found = client errors.",
      [(f'sum by (status) (rate(ray_tts_requests_total{{{APP}, {MODEL}, status!="ok"}}{RI})) / ignoring(status) '
        f"group_left sum(rate(ray_tts_requests_total{{{APP}, {MODEL}}}{RI}))", "{{status}}")],
      unit="percentunit", stack=True)
panel("Rejections by limit",
      "Requests refused at capacity per second, by the limit that refused them (ray_tts_rejections_total): "
      "ingress_open_requests = an ingress replica's max_open_requests, serve_queue = a deployment handle's "
      "max_queued_requests (Talker or Code2Wav), engine_queue = a Talker engine's max_waiting.",
      [(f"sum by (limit) (rate(ray_tts_rejections_total{{{APP}, {MODEL}}}{RI}))", "{{limit}}")],
      unit="reqps", stack=True)
panel("Speech cut at the frame cap",
      "Talker requests (long inputs' pieces included) that reached their frame cap without EOS when the client set "
      "no cap of its own, per second (ray_tts_frame_cap_cuts_total): their speech was cut; should stay at 0.",
      [(f"sum by (model) (rate(ray_tts_frame_cap_cuts_total{{{APP}, {MODEL}}}{RI}))", "{{model}}")],
      unit="reqps")
panel("Open streams",
      "Requests being generated right now, per model (ray_tts_open_streams, summed over ingress replicas).",
      [(f"sum by (model) (ray_tts_open_streams{{{APP}, {MODEL}}})", "{{model}}")])
panel("Batch job items",
      "Items of every batch job in the store by state (ray_tts_batch_items); each ingress replica reports the same "
      "store-wide counts, so max, not sum.",
      [(f"max by (state) (ray_tts_batch_items{{{APP}}})", "{{state}}")])
panel("Time to first audio: streaming",
      "Request arrival to the first audio byte, streamed requests (ray_tts_time_to_first_audio_ms, stream=\"true\").",
      [(q(0.5, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="true"', ""), "p50"),
       (q(0.9, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="true"', ""), "p90"),
       (q(0.99, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="true"', ""), "p99"),
       (mean("ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="true"', ""), "mean" + APPROX)],
      unit="ms")
panel("Time to audio: non-streaming",
      "Request arrival to the whole body, non-streamed requests (ray_tts_time_to_first_audio_ms, stream=\"false\").",
      [(q(0.5, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="false"', ""), "p50"),
       (q(0.9, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="false"', ""), "p90"),
       (q(0.99, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="false"', ""), "p99")],
      unit="ms")
panel("Real-time factor",
      "Wall time of a request / duration of its audio (ray_tts_real_time_factor). Below 1 = faster than real time.",
      [(q(0.5, "ray_tts_real_time_factor", f"{APP}, {MODEL}", ""), "p50"),
       (q(0.9, "ray_tts_real_time_factor", f"{APP}, {MODEL}", ""), "p90"),
       (q(0.99, "ray_tts_real_time_factor", f"{APP}, {MODEL}", ""), "p99"),
       (mean("ray_tts_real_time_factor", f"{APP}, {MODEL}", ""), "mean" + APPROX)])
panel("Audio produced",
      "Seconds of audio produced per second of wall time, per model (ray_tts_audio_seconds_total): "
      "how many real-time streams the service sustains.",
      [(f"sum by (model) (rate(ray_tts_audio_seconds_total{{{APP}, {MODEL}}}{RI}))", "{{model}}")],
      w=8)
panel("Time to first audio p90 by model",
      "Streaming p90 per served model.",
      [(q(0.9, "ray_tts_time_to_first_audio_ms", f'{APP}, {MODEL}, stream="true"', "model"), "{{model}}")],
      unit="ms", w=8)
panel("First audio by stage (approximate mean)",
      "Where first audio goes, hop by hop (ray_tts_first_audio_stage_ms; the Server-Timing header of each "
      "response, deployments/first_audio_timing.py): ingress work, hops to/from each stage, the Talker engine, "
      "the Code2Wav queue and decode.",
      [(mean("ray_tts_first_audio_stage_ms", f'{APP}, {MODEL}, stage!="total"', "stage"), "{{stage}}" + APPROX),
       (q(0.9, "ray_tts_first_audio_stage_ms", f'{APP}, {MODEL}, stage="total"', ""), "total p90")],
      unit="ms", w=8)
panel("Real-time factor p90 by model",
      "p90 per served model.",
      [(q(0.9, "ray_tts_real_time_factor", f"{APP}, {MODEL}", "model"), "{{model}}")], w=8)

panel("Client buffer lead (smallest per stream)",
      "Per stream, the smallest lead of audio sent over a real-time player started at the first byte "
      "(ray_tts_client_buffer_lead_s); negative = the player ran dry. Low percentiles are what matters.",
      [(q(0.01, "ray_tts_client_buffer_lead_s", f"{APP}, {MODEL}", ""), "p1"),
       (q(0.1, "ray_tts_client_buffer_lead_s", f"{APP}, {MODEL}", ""), "p10"),
       (q(0.5, "ray_tts_client_buffer_lead_s", f"{APP}, {MODEL}", ""), "p50")],
      unit="s", w=6, min0=False)
panel("Streams that ran dry",
      "Share of streams whose real-time player would have run dry at least once, per model "
      "(ray_tts_client_dry_streams_total over the streams counted by ray_tts_client_buffer_lead_s_count).",
      [(f"sum by (model) (rate(ray_tts_client_dry_streams_total{{{APP}, {MODEL}}}{RI})) / "
        f"sum by (model) (rate(ray_tts_client_buffer_lead_s_count{{{APP}, {MODEL}}}{RI}))", "{{model}}")],
      unit="percentunit", w=6)
panel("Client underruns",
      "Gaps a real-time player would hear (ray_tts_client_underruns_total): per second and per stream.",
      [(f"sum by (model) (rate(ray_tts_client_underruns_total{{{APP}, {MODEL}}}{RI}))", "per s {{model}}"),
       (f"sum by (model) (rate(ray_tts_client_underruns_total{{{APP}, {MODEL}}}{RI})) / "
        f"sum by (model) (rate(ray_tts_client_buffer_lead_s_count{{{APP}, {MODEL}}}{RI}))", "per stream {{model}}")],
      w=6)
panel("Underrun time",
      "Seconds of gaps such a player would hear (ray_tts_client_underrun_seconds_total), as a share of the audio "
      "produced and per stream.",
      [(f"sum by (model) (rate(ray_tts_client_underrun_seconds_total{{{APP}, {MODEL}}}{RI})) / "
        f"sum by (model) (rate(ray_tts_audio_seconds_total{{{APP}, {MODEL}}}{RI}))", "share of audio {{model}}"),
       (f"sum by (model) (rate(ray_tts_client_underrun_seconds_total{{{APP}, {MODEL}}}{RI})) / "
        f"sum by (model) (rate(ray_tts_client_buffer_lead_s_count{{{APP}, {MODEL}}}{RI}))", "s per stream {{model}}")],
      w=6)

# ------------------------------------------------------------------ talker
row("Talker (engine)")
panel("Engine streams: running / waiting / slots",
      "Per model, summed over Talker replicas: requests in engine slots (ray_tts_talker_running), waiting for a "
      "slot (ray_tts_talker_waiting, the autoscaling signal), live-text requests parked waiting for their next "
      "text (ray_tts_talker_waiting_for_text; they keep their slot) and slots (ray_tts_talker_slots).",
      [(f"sum by (model) (ray_tts_talker_running{{{APP}, {MODEL}}})", "running {{model}}"),
       (f"sum by (model) (ray_tts_talker_waiting{{{APP}, {MODEL}}})", "waiting {{model}}"),
       (f"sum by (model) (ray_tts_talker_waiting_for_text{{{APP}, {MODEL}}})", "waiting for text {{model}}"),
       (f"sum by (model) (ray_tts_talker_slots{{{APP}, {MODEL}}})", "slots {{model}}")])
panel("KV cache usage",
      "Reserved fraction of KV-cache positions per Talker replica (ray_tts_talker_kv_usage).",
      [(f"max by (model, replica) (ray_tts_talker_kv_usage{{{APP}, {MODEL}}})", "{{replica}}")],
      unit="percentunit")
panel("Frames generated",
      "Codec frames per second (ray_tts_talker_frames_total); 12.5 frames = 1 s of audio.",
      [(f"sum by (model) (rate(ray_tts_talker_frames_total{{{APP}, {MODEL}}}{RI}))", "{{model}}")])
panel("Engine batch size",
      "Running requests per decode step, averaged per stats refresh (ray_tts_talker_mean_batch_size): mean and p90 "
      "of those averages.",
      [(mean("ray_tts_talker_mean_batch_size", f"{APP}, {MODEL}", "model"), "mean {{model}}" + APPROX),
       (q(0.9, "ray_tts_talker_mean_batch_size", f"{APP}, {MODEL}", "model"), "p90 {{model}}")], w=12)
panel("Slot occupancy per replica",
      "running / slots per Talker replica: near 1 with waiting > 0 means the replica is the bottleneck.",
      [(f"sum by (replica) (ray_tts_talker_running{{{APP}, {MODEL}}}) / "
        f"sum by (replica) (ray_tts_talker_slots{{{APP}, {MODEL}}})", "{{replica}}")],
      unit="percentunit", w=12)

# ------------------------------------------------------------------ code2wav
row("Code2Wav (codec decoder)")
panel("Decode call latency",
      "Arrival of a decode_many call at Code2Wav to its answer, wait + decode, per call "
      "(ray_tts_code2wav_call_latency_ms).",
      [(q(0.5, "ray_tts_code2wav_call_latency_ms", APP, ""), "p50"),
       (q(0.9, "ray_tts_code2wav_call_latency_ms", APP, ""), "p90"),
       (q(0.99, "ray_tts_code2wav_call_latency_ms", APP, ""), "p99"),
       (mean("ray_tts_code2wav_call_latency_ms", APP, ""), "mean" + APPROX)], unit="ms", w=6)
panel("Batch decode time",
      "Decode time of one batch of chunks (ray_tts_code2wav_batch_decode_ms).",
      [(q(0.5, "ray_tts_code2wav_batch_decode_ms", APP, ""), "p50"),
       (q(0.99, "ray_tts_code2wav_batch_decode_ms", APP, ""), "p99"),
       (mean("ray_tts_code2wav_batch_decode_ms", APP, ""), "mean" + APPROX)], unit="ms", w=6)
panel("Batch size",
      "Chunks decoded together (ray_tts_code2wav_batch_size).",
      [(mean("ray_tts_code2wav_batch_size", APP, ""), "mean" + APPROX),
       (q(0.9, "ray_tts_code2wav_batch_size", APP, ""), "p90"),
       (f"sum(rate(ray_tts_code2wav_batch_size_count{{{APP}}}{RI}))", "batches/s")], w=6)
panel("Queued chunks",
      "Chunks waiting for a decode batch, per Code2Wav replica (ray_tts_code2wav_queued_chunks).",
      [(f"sum by (replica) (ray_tts_code2wav_queued_chunks{{{APP}}})", "{{replica}}")], w=6)
panel("Stateful decode paths",
      "Chunks decoded from their stream's carried state (continued) or over their left context (fresh: first "
      "chunks, streams another replica holds, evicted states) (ray_tts_code2wav_state_chunks_total); chunks of "
      "calls naming the replica holding their streams, by where they landed (ray_tts_code2wav_named_chunks_total).",
      [(f"sum by (path) (rate(ray_tts_code2wav_state_chunks_total{{{APP}}}{RI}))", "{{path}}"),
       (f"sum by (landed) (rate(ray_tts_code2wav_named_chunks_total{{{APP}}}{RI}))", "named, landed {{landed}}")],
      unit="cps", w=6)

# ------------------------------------------------------------------ aligner
row("Aligner (word timestamps)")
panel("Align call latency",
      "Arrival of an align call (one piece of speech) to its words: wait for the aligner thread + its forward "
      "(ray_tts_aligner_call_latency_ms). A stream's timestamps lag its audio by about this much.",
      [(q(0.5, "ray_tts_aligner_call_latency_ms", APP, ""), "p50"),
       (q(0.95, "ray_tts_aligner_call_latency_ms", APP, ""), "p95"),
       (mean("ray_tts_aligner_call_latency_ms", APP, ""), "mean" + APPROX)], unit="ms", w=8)
panel("Aligner batch size",
      "Pieces timed in one forward (ray_tts_aligner_batch_size), and forwards per second.",
      [(mean("ray_tts_aligner_batch_size", APP, ""), "mean" + APPROX),
       (q(0.9, "ray_tts_aligner_batch_size", APP, ""), "p90"),
       (f"sum(rate(ray_tts_aligner_batch_size_count{{{APP}}}{RI}))", "forwards/s")], w=8)
panel("Aligner cost per audio second",
      "Wall seconds of a forward per second of speech it timed (ray_tts_aligner_seconds_per_audio_second): the "
      "aligner's share of its device per real-time second of timed speech.",
      [(mean("ray_tts_aligner_seconds_per_audio_second", APP, ""), "mean" + APPROX),
       (q(0.9, "ray_tts_aligner_seconds_per_audio_second", APP, ""), "p90")], unit="s", w=8)

# ------------------------------------------------------------------ serve built-ins
row("Ray Serve")
panel("HTTP requests",
      "Requests through Serve's proxies by route and status code (ray_serve_num_http_requests_total).",
      [(f'sum by (route, status_code) (rate(ray_serve_num_http_requests_total{{{APP}, route!~"/-/.*"}}{RI}))',
        "{{route}} {{status_code}}")], unit="reqps")
panel("HTTP errors",
      "Error responses by route and code (ray_serve_num_http_error_requests_total).",
      [(f'sum by (route, error_code) (rate(ray_serve_num_http_error_requests_total{{{APP}, route!~"/-/.*"}}{RI}))',
        "{{route}} {{error_code}}")], unit="reqps")
panel("HTTP latency (whole response)",
      "Proxy-measured latency of the whole response (ray_serve_http_request_latency_ms); for streams this is the "
      "stream's duration, see time to first audio for responsiveness.",
      [(q(0.5, "ray_serve_http_request_latency_ms", f'{APP}, route!~"/-/.*"', ""), "p50"),
       (q(0.99, "ray_serve_http_request_latency_ms", f'{APP}, route!~"/-/.*"', ""), "p99")], unit="ms")
panel("Replicas",
      "Healthy replicas (ray_serve_deployment_replica_healthy) and the autoscaler's target "
      "(ray_serve_autoscaling_target_replicas) and raw desired count (ray_serve_autoscaling_desired_replicas).",
      [(f"sum by (deployment) (ray_serve_deployment_replica_healthy{{{APP}}})", "healthy {{deployment}}"),
       (f"max by (deployment) (ray_serve_autoscaling_target_replicas{{{APP}}})", "target {{deployment}}"),
       (f"max by (deployment) (ray_serve_autoscaling_desired_replicas{{{APP}}})", "desired {{deployment}}")])
panel("Queued at handles",
      "Requests queued at callers, not yet assigned to a replica (ray_serve_deployment_queued_queries): "
      "streams waiting for a Talker, chunks waiting for Code2Wav, HTTP requests waiting for an ingress.",
      [(f"sum by (deployment) (ray_serve_deployment_queued_queries{{{APP}}})", "{{deployment}}")])
panel("Ongoing requests at replicas",
      "Requests assigned to replicas, as the handles see them (ray_serve_num_ongoing_requests_at_replicas), and "
      "what the autoscaler acts on (ray_serve_autoscaling_total_requests).",
      [(f"sum by (deployment) (ray_serve_num_ongoing_requests_at_replicas{{{APP}}})", "ongoing {{deployment}}"),
       (f"max by (deployment) (ray_serve_autoscaling_total_requests{{{APP}}})", "autoscaler {{deployment}}")])
panel("Requests in each replica",
      "Requests being processed per replica (ray_serve_replica_processing_queries).",
      [(f"sum by (deployment, replica) (ray_serve_replica_processing_queries{{{APP}}})", "{{replica}}")])
panel("Deployment latency p99",
      "Per deployment, time in the replica (ray_serve_deployment_processing_latency_ms); Talker calls are whole "
      "streams, Code2Wav calls one chunk.",
      [(q(0.99, "ray_serve_deployment_processing_latency_ms", APP, "deployment"), "{{deployment}}")], unit="ms")
panel("Ongoing HTTP requests per proxy",
      "Open HTTP connections per proxy (ray_serve_num_ongoing_http_requests).",
      [("sum by (node_ip_address) (ray_serve_num_ongoing_http_requests)", "{{node_ip_address}}")])

# ------------------------------------------------------------------ GPUs
row("GPUs")
panel("GPU utilization",
      "Per host and GPU (ray_node_gpus_utilization). Every raylet of a host reports all of its GPUs: max dedups "
      "the one-raylet-per-GPU layout.",
      [("max by (ip, GpuIndex, GpuDeviceName) (ray_node_gpus_utilization)", "{{ip}} gpu {{GpuIndex}} {{GpuDeviceName}}")],
      unit="percent", w=12)
panel("GPU memory used",
      "Per host and GPU (ray_node_gram_used, reported in MiB). Talker and Code2Wav cap their own share: Ray does "
      "not isolate GPU memory.",
      [("max by (ip, GpuIndex) (ray_node_gram_used) * 1024 * 1024", "{{ip}} gpu {{GpuIndex}}")], unit="bytes", w=12)


def var_query(name, label, query, regex=""):
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "definition": query, "query": {"query": query, "refId": f"{name}-query"},
        "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "regex": regex, "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0,
    }


dashboard = {
    "title": "Qwen3-TTS on Ray Serve",
    "uid": "qwen3-tts-serve",
    "description": "Qwen3-TTS serving: requests, time to first audio, real-time factor, Talker engine, Code2Wav "
                   "batching, Ray Serve replicas and queues, GPUs. Metrics: deployments/metrics.py (ray_ prefix).",
    "tags": ["ray", "serve", "tts", "qwen3-tts"],
    "editable": True,
    "graphTooltip": 1,
    "schemaVersion": 39,
    "version": 1,
    "refresh": "10s",
    "time": {"from": "now-30m", "to": "now"},
    "timepicker": {},
    "timezone": "",
    "links": [],
    "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                              "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                              "name": "Annotations & Alerts", "type": "dashboard"}]},
    "templating": {"list": [
        {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "includeAll": False, "multi": False, "refresh": 1, "regex": "", "options": []},
        var_query("application", "Application", "label_values(ray_serve_deployment_replica_healthy, application)"),
        var_query("model", "Model", "label_values(ray_tts_talker_slots, model)"),
    ]},
    "panels": panels,
}

with open(OUT, "w", encoding="utf-8") as f:
    json.dump(dashboard, f, indent=2)
    f.write("\n")
print(f"{OUT}: {len(panels)} panels")
