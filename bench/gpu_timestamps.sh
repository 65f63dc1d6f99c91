#!/usr/bin/env bash
# Word timestamps on one GPU (docs/results/timestamps_h200.json):
#   1. the aligner alone: its first forwards after the warm-up (bench/aligner_first_forward.py: one-time work in a
#      request's wait) and its cost (bench/aligner_cost.py: ms per second of speech, 6 s pieces, batch 1-64);
#   2. the fastest one-GPU recipe (configs/high_concurrency.yaml, MPS, throughput-optimized Serve, HAProxy, 4 ingress
#      replicas) with a full-size random-weight aligner beside Code2Wav (docs/aligner.md "Configs": each Aligner replica
#      0.05 GPU, Code2Wav the rest of its half, $ALIGNER_REPLICAS replicas), then bench.loadgen over SSE with fixed 6 s outputs: 64 streams with timestamps (how long after
#      its audio each timestamps event came), 256 streams without, 256 with.
# From the repo root with .gpubundle carried:
#   source .gpubundle/install_bundle.sh .gpubundle && bash bench/gpu_timestamps.sh
# Results in $OUT: first_forward.jsonl (+ _stacks.log), aligner_cost.json, ts64/, plain256/, ts256/ (bench.loadgen results), stats_after_ts64.json and
# stats_after_ts256.json (bench.replica_stats: where the Aligner's time went), timestamps.json (the
# fields of docs/results/timestamps_h200.json but `parity_full_size`), serve_errors.log. SKIP_COST=1 skips step 1;
# STAGGER_S=1.5 starts the streams over 1.5 s (about one request's time) instead of all at once.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$REPO"
OUT=${OUT:-bench/out/timestamps}; ALIGNER=${ALIGNER:-/tmp/aligner-0.6b}; FRAMES=${FRAMES:-75}
export ALIGNER_REPLICAS=${ALIGNER_REPLICAS:-1}  # Aligner replicas beside Code2Wav on the GPU (each its own host thread)
C2W_GPUS=$(python3 -c "print(round(0.5 - 0.05 * $ALIGNER_REPLICAS, 2))")  # Ray's GPU fractions add up to one
mkdir -p "$OUT"
export PYTHONPATH="$REPO:${PYTHONPATH:-}"
[ -f "$ALIGNER/model.safetensors" ] || python3 -m stages.aligner.random_checkpoint "$ALIGNER" --device cuda > /dev/null
if [ -z "${SKIP_COST:-}" ]; then
  # first: kernels PyTorch compiles at run time are cached on disk, so only a fresh machine's first process shows them
  echo "=== the first forwards after the warm-up $(date -u +%FT%TZ)"
  timeout 240 python3 -m bench.aligner_first_forward --checkpoint "$ALIGNER" > "$OUT/first_forward.jsonl" \
    2> "$OUT/first_forward_stacks.log"; cat "$OUT/first_forward.jsonl"
  echo "=== aligner cost $(date -u +%FT%TZ)"
  timeout 150 python3 -m bench.aligner_cost --checkpoint "$ALIGNER" --seconds 6 --batches 1,8,32,64 \
    --out "$OUT/aligner_cost.json" 2>&1 | tail -3
fi
curl -sf -m 5 http://127.0.0.1:8000/ready > /dev/null || {
  nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS control daemon started"
  aligner='aligner={"model":"'"$ALIGNER"'","gpu_memory_fraction":0.05,"deployment_config":{"num_replicas":'"$ALIGNER_REPLICAS"',"ray_actor_options":{"num_cpus":1,"num_gpus":0.05}}}'
  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 OUT="$OUT/setup" CONFIG=configs/high_concurrency.yaml \
    SET="ingress.deployment_config.autoscaling_config.min_replicas=4 code2wav.deployment_config.ray_actor_options.num_gpus=$C2W_GPUS $aligner${EXTRA_SET:+ $EXTRA_SET}" \
    bash bench/gpu_serve_runbook.sh setup || exit 1
}
load() {  # closed loop, SSE, fixed-length 6 s outputs; STAGGER_S spreads the streams' starts (0: all at once, a burst)
  timeout 170 python3 -m bench.loadgen --url http://127.0.0.1:8000 --mode closed --max-new-tokens "$FRAMES" \
    --fixed-length --stream-format sse --processes 4 --warmup 16 --no-plots --progress none \
    --stagger-s "${STAGGER_S:-0}" "$@" 2>&1 | tail -4
}
aligner_stats() {  # each Aligner replica's counters since it started (bench/replica_stats.py)
  timeout 60 python3 -m bench.replica_stats --out "$OUT/$1" > /dev/null 2>&1 || echo "replica stats failed"
}
echo "=== 64 streams, timestamps $(date -u +%FT%TZ)"
load --concurrency 64 --requests 512 --extra '{"timestamps": "word"}' --out "$OUT/ts64"
aligner_stats stats_after_ts64.json
echo "=== 256 streams, no timestamps $(date -u +%FT%TZ)"
load --concurrency 256 --requests 1536 --out "$OUT/plain256"
echo "=== 256 streams, timestamps $(date -u +%FT%TZ)"
load --concurrency 256 --requests 1536 --extra '{"timestamps": "word"}' --out "$OUT/ts256"
aligner_stats stats_after_ts256.json
python3 - "$OUT" <<'EOF'
import datetime, json, os, subprocess, sys
from pathlib import Path
out = Path(sys.argv[1])
def point(name):
    p = out / name / "results.json"
    return json.loads(p.read_text())["points"][-1] if p.exists() else {}
cost = json.loads((out / "aligner_cost.json").read_text()) if (out / "aligner_cost.json").exists() else {}
first = out / "first_forward.jsonl"  # the warm-up, then each forward's time: a one-time cost shows in the first
first_forwards = [json.loads(line) for line in first.read_text().splitlines() if line.startswith("{")] \
    if first.exists() else []
def aligner(name):  # the Aligner replicas' summaries (prepare, forward, wait) since start, after that load
    p = out / name
    return json.loads(p.read_text()).get("aligner") if p.exists() else None
ts64, plain, ts256 = point("ts64"), point("plain256"), point("ts256")
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
result = {
    "device": f"one {gpu.stdout.strip().splitlines()[0] if gpu.stdout.strip() else 'GPU'}",
    "date": datetime.date.today().isoformat(),
    "command": f"ALIGNER_REPLICAS={os.environ.get('ALIGNER_REPLICAS', '1')} STAGGER_S={os.environ.get('STAGGER_S', '0')} "
               "bash bench/gpu_timestamps.sh",
    # at batch 32 (what a loaded replica runs); every batch size in details
    "aligner_ms_per_audio_s": (cost.get("aligner_ms_per_audio_s") or {}).get("32"),
    "ts_lag_p95_ms_64": (ts64.get("timestamps_lag_ms") or {}).get("p95"),
    "audio_s_per_s_with_ts_256": ts256.get("audio_s_per_s"),
    "audio_s_per_s_without_ts_256": plain.get("audio_s_per_s"),
    "details": {"aligner_cost": cost, "first_forwards": first_forwards,
                "aligner_replicas": {"after_ts64": aligner("stats_after_ts64.json"),
                                     "after_ts256": aligner("stats_after_ts256.json")},
                "failed": {k: p.get("failed") for k, p in
                                                  (("ts64", ts64), ("plain256", plain), ("ts256", ts256))},
                "timestamps_failed": {"ts64": ts64.get("timestamps_failed"), "ts256": ts256.get("timestamps_failed")},
                "ttfa_p95_ms": {k: (p.get("ttfa_ms") or {}).get("p95") for k, p in
                                (("ts64", ts64), ("plain256", plain), ("ts256", ts256))},
                "continuous_share": {k: p.get("continuous_share") for k, p in
                                     (("ts64", ts64), ("plain256", plain), ("ts256", ts256))}},
}
(out / "timestamps.json").write_text(json.dumps(result, indent=2) + "\n")
print(json.dumps({k: v for k, v in result.items() if k != "details"}))
EOF
grep -h -A8 -E ' ERROR |Traceback' /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null | cut -c1-400 | head -300 \
  > "$OUT/serve_errors.log"
