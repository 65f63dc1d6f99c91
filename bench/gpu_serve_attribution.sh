#!/usr/bin/env bash
# Where does a served request's first audio go? (issue 11). On the GPU machine, repo root, .gpubundle carried:
# starts the server (runbook setup), then per concurrency C in $LEVELS drives a closed loop and, while it runs,
# reads the Talker engine's own statistics over a window (bench.serve_engine_stats): its step, mean batch, and
# each request's time inside the engine from add to admission and to its first chunk. The load generator's
# time to first audio minus the engine's first-chunk time is the serving path's share (hops, the proxy, the
# first chunk's decode). Each response's Server-Timing header splits the rest hop by hop
# (deployments/first_audio_timing.py): the load generator's results.md has a table of its stages per level.
# Results in $OUT: load_<C>.log, results_<C>.md, results_<C>.json.gz (per request), stats_<C>.json.
# DIRECT=1: HAProxy straight to the ingress replicas + throughput-optimized Serve (the settings
# configs/high_concurrency.yaml's header recommends); MPS=1: the CUDA MPS daemon runs while the server does;
# SET=...: runbook overrides of the Serve config (e.g. SET="streaming.first_chunk_frames=2").
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"; LEVELS=${LEVELS:-1,256}; W=${W:-/tmp/qwen3-serve-bench}
source .gpubundle/install_bundle.sh .gpubundle >/dev/null 2>&1
if [ "${DIRECT:-0}" = 1 ]; then export RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1; fi
if [ "${MPS:-0}" = 1 ]; then nvidia-cuda-mps-control -d && echo "MPS control daemon started"; fi
BUDGET_S=300 OUT="$OUT" bash bench/gpu_serve_runbook.sh setup 2>&1 | grep -E "ready after|error|Error" | tail -3
if [ "${MPS:-0}" = 1 ]; then  # the replicas' processes should show as MPS clients (type M+C)
  echo get_server_list | nvidia-cuda-mps-control; nvidia-smi | tail -6
fi
for C in ${LEVELS//,/ }; do
  N=$(( C == 1 ? 30 : C * 10 ))  # the load outlasts the stats window (6 s in, 8 s long)
  python3 -m bench.loadgen --url http://127.0.0.1:8000 --mode closed --concurrency "$C" --requests "$N" \
    --max-new-tokens 75 --fixed-length --warmup 4 --timeout 300 --progress none --out "$W/attr_$C" \
    > "$OUT/load_$C.log" 2>&1 &
  LOAD=$!
  sleep 6
  python3 -m bench.serve_engine_stats --seconds 8 --out "$OUT/stats_$C.json" 2>/dev/null
  wait "$LOAD"
  grep -E "^\| $C \|" "$W/attr_$C/results.md" | head -2
  cp "$W/attr_$C/results.md" "$OUT/results_$C.md"; gzip -c "$W/attr_$C/results.json" > "$OUT/results_$C.json.gz"
  cat "$OUT/stats_$C.json"; echo
done
BUDGET_S=60 OUT="$OUT" bash bench/gpu_serve_runbook.sh stop >/dev/null 2>&1
if [ "${MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
