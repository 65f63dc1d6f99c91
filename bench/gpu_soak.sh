#!/usr/bin/env bash
# A soak on a GPU host: the fastest one-GPU recipe (configs/high_concurrency.yaml, MPS, throughput-optimized Serve,
# HAProxy; on several GPUs configs/replicas.yaml), then bench/soak.py's mixed traffic (every format, SSE, WebSocket,
# drops) for $MINUTES at $CONCURRENCY. From the repo root with .gpubundle carried:
#   source .gpubundle/install_bundle.sh .gpubundle && MINUTES=20 CONCURRENCY=256 bash bench/gpu_soak.sh
# Results in $OUT: soak.json, env.txt (Python, torch, PyAV), serve_errors.log (every ERROR line and traceback of
# the Serve logs, first 400 lines) and serve_tail.log. The server stays up while the machine is warm (a later call
# runs another soak against it).
# A soak longer than one call (the device tool's calls last <= 10 min; the machine stays warm ~30 s between them):
#   call 1: DETACH=1 MINUTES=20 bash bench/gpu_soak.sh   (setup, then the soak in its own session; returns at once)
#   calls 2..n: WAIT_S=540 bash bench/gpu_soak.sh        (waits up to WAIT_S for the detached soak, then collects)
# The detached soak writes under $SOAK_DIR (default /tmp/qwen3-soak) until a call collects it into $OUT.
# On a host of several GPUs, the soak on one of them while other calls use the rest: every call of the soak (and
# bench/gpu_faults.sh after it) exports the same CUDA_VISIBLE_DEVICES and an MPS pipe directory of that GPU's own,
#   export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-gpu0 CUDA_MPS_LOG_DIRECTORY=/tmp/mps-gpu0-log
# so the MPS daemon it starts serves only that GPU and processes without those variables never connect to it.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$REPO"
OUT=${OUT:-bench/out/soak}; MINUTES=${MINUTES:-3}; CONCURRENCY=${CONCURRENCY:-256}; FRAMES=${FRAMES:-75}
mkdir -p "$OUT"
{ python3 --version; python3 -c "import torch; print('torch', torch.__version__)";
  python3 -c "import av; print('av', av.__version__)" 2>&1 | tail -1; nvidia-smi -L; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
n=$(nvidia-smi -L | grep -c '^GPU')
[ -n "${CUDA_VISIBLE_DEVICES:-}" ] && n=$(tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .)
[ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "${CUDA_MPS_LOG_DIRECTORY:-/tmp}"
config=configs/high_concurrency.yaml; set_args=""
if [ "$n" -gt 1 ]; then
  config=configs/replicas.yaml
  set_args="models.0.deployment_config.num_replicas=$n code2wav.deployment_config.num_replicas=$n ingress.deployment_config.autoscaling_config.min_replicas=$((4 * n))"
fi
curl -sf -m 5 http://127.0.0.1:8000/ready > /dev/null || {
  nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS control daemon started"
  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 OUT="$OUT/setup" CONFIG=$config SET="$set_args" \
    bash bench/gpu_serve_runbook.sh setup || exit 1
}
SOAK_DIR=${SOAK_DIR:-/tmp/qwen3-soak}
soak_cmd=(timeout $(( ${MINUTES%.*} * 60 + 150 )) python3 -m bench.soak --minutes "$MINUTES" --concurrency "$CONCURRENCY"
          --frames "$FRAMES" --warmup-s "${WARMUP_S:-60}" --sample-s 30)
if [ -n "${DETACH:-}" ]; then  # its own session: it outlives this call while the machine stays warm
  mkdir -p "$SOAK_DIR" && rm -f "$SOAK_DIR/done"
  echo "=== detached soak $(date -u +%FT%TZ) $MINUTES min at $CONCURRENCY -> $SOAK_DIR"
  PYTHONPATH="$REPO:${PYTHONPATH:-}" setsid nohup bash -c '"$@" --out "$0/soak.json" > "$0/soak.log" 2>&1; touch "$0/done"' \
    "$SOAK_DIR" "${soak_cmd[@]}" < /dev/null > /dev/null 2>&1 &
  exit 0
fi
if [ -d "$SOAK_DIR" ]; then  # a detached soak: wait for it (up to WAIT_S), then collect it
  for _ in $(seq 1 "${WAIT_S:-540}"); do [ -f "$SOAK_DIR/done" ] && break; sleep 1; done
  if [ ! -f "$SOAK_DIR/done" ]; then echo "soak still running: $(tail -c 300 "$SOAK_DIR/soak.log")"; exit 0; fi
  cp "$SOAK_DIR/soak.json" "$OUT/" 2>/dev/null; tail -30 "$SOAK_DIR/soak.log"; rm -rf "$SOAK_DIR"
else
  echo "=== soak $(date -u +%FT%TZ) $MINUTES min at $CONCURRENCY"
  PYTHONPATH="$REPO:${PYTHONPATH:-}" "${soak_cmd[@]}" --out "$OUT/soak.json" 2>&1 | tail -30
fi
logs=/tmp/ray/session_latest/logs/serve
grep -h -A12 -E ' ERROR |Traceback' "$logs"/*.log 2>/dev/null | cut -c1-400 | head -400 > "$OUT/serve_errors.log"
echo "error lines: $(grep -h -c -E ' ERROR ' "$logs"/*.log 2>/dev/null | paste -sd+ | bc)"
PYTHONPATH="$REPO:${PYTHONPATH:-}" timeout 60 python3 -m bench.replica_stats --out "$OUT/replica_stats.json" > /dev/null 2>&1 \
  || echo "no replica stats"
W=${W:-/tmp/qwen3-serve-bench}; [ -f "$W/serve.log" ] && tail -n 400 "$W/serve.log" | cut -c1-600 > "$OUT/serve_tail.log"
