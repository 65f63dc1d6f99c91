#!/usr/bin/env bash
# Faults under load on a multi-GPU host (issue: failures touch only what failed): configs/replicas.yaml with one
# co-located pair per GPU (the fastest recipe: MPS, throughput-optimized Serve, HAProxy), then bench/faults.py:
# kill the busiest Talker replica, then a Code2Wav replica, then `serve deploy` a changed config, each under
# $STREAMS long streams. From the repo root with .gpubundle carried:
#   source .gpubundle/install_bundle.sh .gpubundle && STREAMS=512 bash bench/gpu_faults.sh
# After bench/gpu_soak.sh on one GPU, against its server: CONFIG=configs/high_concurrency.yaml FAULTS=redeploy
#   STREAMS=256 bash bench/gpu_faults.sh
# Results: $OUT/faults_<fault>.json; the server stays up for a soak call after it (bench/soak.py).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$REPO"
OUT=${OUT:-bench/out/faults}; STREAMS=${STREAMS:-512}; FRAMES=${FRAMES:-400}; W=${W:-/tmp/qwen3-serve-bench}
mkdir -p "$OUT"
n=$(nvidia-smi -L | grep -c '^GPU')
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && n=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)  # as gpu_soak.sh
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "${CUDA_MPS_LOG_DIRECTORY:-/tmp}"
nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS control daemon started"
# CONFIG=configs/high_concurrency.yaml (SET as that server was started: none on one GPU) reuses a server
# bench/gpu_soak.sh left running: the setup is skipped when the same config is already up
config=${CONFIG:-configs/replicas.yaml}
set_args=${SET:-}
if [ "$config" = configs/replicas.yaml ]; then
  set_args="models.0.deployment_config.num_replicas=$n code2wav.deployment_config.num_replicas=$n ingress.deployment_config.autoscaling_config.min_replicas=$((4 * n))"
fi
RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 OUT="$OUT/setup" CONFIG=$config SET="$set_args" \
  bash bench/gpu_serve_runbook.sh setup || exit 1
for fault in ${FAULTS:-talker code2wav redeploy}; do
  extra=()
  if [ "$fault" = redeploy ]; then  # the same app with one ingress setting changed: Serve rolls the replicas
    sed 's/max_open_requests: [0-9]*/max_open_requests: 600/' "$W/serve.yaml" > "$W/serve.changed.yaml"
    extra=(--config "$W/serve.changed.yaml")
  fi
  echo "=== $fault $(date -u +%FT%TZ)"
  PYTHONPATH="$REPO:${PYTHONPATH:-}" timeout 300 python3 -m bench.faults --fault "$fault" --streams "$STREAMS" --frames "$FRAMES" \
    "${extra[@]}" --out "$OUT/faults_$fault.json" 2>&1 | grep -v ' INFO \| WARNING ' | tail -40
done
