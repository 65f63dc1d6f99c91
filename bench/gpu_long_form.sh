#!/usr/bin/env bash
# Long-form and batch priority on one GPU (docs/results/long_form_h200.json): the fastest one-GPU recipe
# (configs/high_concurrency.yaml, MPS, throughput-optimized Serve, HAProxy, 4 ingress replicas), then
#   1. a ~10,000-character chapter streamed in one request (bench/long_form.py): first audio, wall time, the
#      longest stall at a piece boundary (random weights: each piece $PIECE_FRAMES frames, EOS suppressed);
#   2. bench/priority.py: a $ITEMS-item batch job alone, real-time Poisson arrivals at $RATE/s alone, then both.
# From the repo root with .gpubundle carried:
#   source .gpubundle/install_bundle.sh .gpubundle && RATE=90 ITEMS=1000 bash bench/gpu_long_form.sh
# Results in $OUT: chapter.json, priority.json, env.txt, serve_errors.log. EXTRA_SET: more `path=value` overrides.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$REPO"
OUT=${OUT:-bench/out/long_form}; RATE=${RATE:-90}; ITEMS=${ITEMS:-1000}; SECONDS_RT=${SECONDS_RT:-40}
mkdir -p "$OUT"
{ python3 -c "import torch, av; print('torch', torch.__version__, 'av', av.__version__)"; nvidia-smi -L; } > "$OUT/env.txt" 2>&1
curl -sf -m 5 http://127.0.0.1:8000/ready > /dev/null || {
  nvidia-cuda-mps-control -d 2>/dev/null && echo "MPS control daemon started"
  RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1 OUT="$OUT/setup" CONFIG=configs/high_concurrency.yaml \
    SET="ingress.deployment_config.autoscaling_config.min_replicas=4${EXTRA_SET:+ $EXTRA_SET}" \
    bash bench/gpu_serve_runbook.sh setup || exit 1
}
export PYTHONPATH="$REPO:${PYTHONPATH:-}"
if [ -z "${SKIP_CHAPTER:-}" ]; then
  echo "=== chapter $(date -u +%FT%TZ)"
  timeout 240 python3 -m bench.long_form --url http://127.0.0.1:8000 --suppress-eos --max-new-tokens "${PIECE_FRAMES:-200}" --out "$OUT/chapter.json" 2>&1 | tail -15
fi
echo "=== priority $(date -u +%FT%TZ) rate $RATE items $ITEMS"
timeout 300 python3 -m bench.priority --url http://127.0.0.1:8000 --rate "$RATE" --seconds "$SECONDS_RT" \
  --items "$ITEMS" --processes 4 --out "$OUT/priority.json" 2>&1 | tail -15
grep -h -A8 -E ' ERROR |Traceback' /tmp/ray/session_latest/logs/serve/*.log 2>/dev/null | cut -c1-400 | head -300 \
  > "$OUT/serve_errors.log"
