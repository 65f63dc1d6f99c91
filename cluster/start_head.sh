#!/usr/bin/env bash
# Start the Ray head of a Qwen3-TTS cluster on this host: GPU-less by default (Serve controller,
# HTTP proxy, CPU replicas such as the ingress). GPUs join with start_workers.sh, one raylet each.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: cluster/start_head.sh [options] [-- extra `ray start` arguments]

Start the Ray head on this host. By default the head has no GPU (CUDA_VISIBLE_DEVICES="",
--num-gpus=0): it runs the Serve controller, the HTTP proxy and CPU replicas (TTSIngress). GPUs join
as one raylet per GPU with cluster/start_workers.sh, which is what pins a deployment to a device.

Options:
  --port PORT                  GCS port (default 6379)
  --dashboard-port PORT        Ray dashboard, also what `serve deploy` talks to (default 8265)
  --metrics-export-port PORT   Prometheus endpoint of the head (default 8080)
  --num-cpus N                 logical CPUs of the head (default: detected; 0 keeps replicas off it)
  --gpu K[:NAME]               give the head GPU K too, pinned, advertising custom resource NAME
                               (default NAME: gpu_K), like one start_workers.sh raylet
  --worker-ports MIN-MAX       ports of the head's worker processes (default 10002-10999;
                               start_workers.sh uses 11000-19999, so both fit on one host)
  --object-store-memory BYTES  object store of the head (default: Ray's, 30% of RAM)
  --restart                    `ray stop` first: stops EVERY Ray process on this host
  --mps                        require the CUDA MPS control daemon (nvidia-cuda-mps-control -d): started
                               before Ray unless one runs, an error if the binary is missing. Without
                               it MPS starts whenever the binary exists and --gpu is given: replicas sharing
                               a GPU overlap their kernels (docs/serving.md, "CUDA MPS"); --stop quits it
  --no-mps                     never start (or quit) the MPS control daemon
  --stop                       `ray stop` and exit (safe to repeat)
  --dry-run                    print the commands, run nothing
  -h, --help                   this text

Without --restart, a head already serving PORT on this host is left alone (exit 0).

Environment: RAY (the ray executable, default `ray`). RAY_SERVE_THROUGHPUT_OPTIMIZED and
RAY_SERVE_ENABLE_HA_PROXY default to 1 (the fastest measured Serve settings; set 0 to opt out). RAY_GRAFANA_HOST, RAY_PROMETHEUS_HOST and
RAY_GRAFANA_IFRAME_HOST are read when the head starts: export them first to get Grafana panels in
the dashboard.

Examples:
  cluster/start_head.sh                                   # GPU-less head on :6379, dashboard on :8265
  cluster/start_head.sh --restart --num-cpus 0 -- --autoscaling-config=~/ray_bootstrap_config.yaml
EOF
}

die() { echo "start_head.sh: $*" >&2; exit 2; }

RAY_BIN="${RAY:-ray}"
PORT=6379
DASHBOARD_PORT=8265
METRICS_PORT=8080
NUM_CPUS=""
GPU_SPEC=""
WORKER_PORTS="10002-10999"
OBJECT_STORE=""
RESTART=0
STOP=0
MPS=auto
DRY_RUN=0
EXTRA=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --dashboard-port) DASHBOARD_PORT="${2:?--dashboard-port needs a value}"; shift 2 ;;
    --metrics-export-port) METRICS_PORT="${2:?--metrics-export-port needs a value}"; shift 2 ;;
    --num-cpus) NUM_CPUS="${2:?--num-cpus needs a value}"; shift 2 ;;
    --gpu) GPU_SPEC="${2:?--gpu needs a value}"; shift 2 ;;
    --worker-ports) WORKER_PORTS="${2:?--worker-ports needs a value}"; shift 2 ;;
    --object-store-memory) OBJECT_STORE="${2:?--object-store-memory needs a value}"; shift 2 ;;
    --restart) RESTART=1; shift ;;
    --stop) STOP=1; shift ;;
    --mps) MPS=1; shift ;;
    --no-mps) MPS=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) usage >&2; die "unknown argument: $1" ;;
  esac
done

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
is_uint "$PORT" || die "--port must be a number, got '$PORT'"
is_uint "$DASHBOARD_PORT" || die "--dashboard-port must be a number, got '$DASHBOARD_PORT'"
is_uint "$METRICS_PORT" || die "--metrics-export-port must be a number, got '$METRICS_PORT'"
[[ -z "$NUM_CPUS" ]] || is_uint "$NUM_CPUS" || die "--num-cpus must be a number, got '$NUM_CPUS'"
[[ -z "$OBJECT_STORE" ]] || is_uint "$OBJECT_STORE" || die "--object-store-memory must be bytes, got '$OBJECT_STORE'"
[[ "$WORKER_PORTS" =~ ^([0-9]+)-([0-9]+)$ ]] || die "--worker-ports must be MIN-MAX, got '$WORKER_PORTS'"
MIN_WORKER_PORT="${BASH_REMATCH[1]}"
MAX_WORKER_PORT="${BASH_REMATCH[2]}"
(( MIN_WORKER_PORT < MAX_WORKER_PORT )) || die "--worker-ports: MIN must be below MAX"

# shellcheck source=cluster/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

# does something on this host already accept connections on the GCS port?
port_in_use() {
  (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

if [[ $STOP -eq 1 ]]; then
  run "$RAY_BIN" stop
  [[ $MPS == 0 ]] || stop_mps
  exit 0
fi

if [[ $RESTART -eq 1 ]]; then
  run "$RAY_BIN" stop
elif port_in_use "$PORT"; then
  echo "start_head.sh: port $PORT is already taken on this host (a running head?); left as it is" \
       "(--restart to restart Ray here)"
  exit 0
fi

GPU_ENV=(CUDA_VISIBLE_DEVICES=)
GPU_ARGS=(--num-gpus=0)
if [[ -n "$GPU_SPEC" ]]; then
  [[ "$GPU_SPEC" =~ ^([0-9]+)(:([A-Za-z_][A-Za-z0-9_.-]*))?$ ]] || die "--gpu must be K or K:NAME, got '$GPU_SPEC'"
  GPU_INDEX="${BASH_REMATCH[1]}"
  GPU_NAME="${BASH_REMATCH[3]:-gpu_${GPU_INDEX}}"
  GPU_ENV=("CUDA_VISIBLE_DEVICES=${GPU_INDEX}")
  GPU_ARGS=(--num-gpus=1 --resources "{\"${GPU_NAME}\": 1}")
fi

ARGS=(
  --head
  --port="$PORT"
  --dashboard-host=0.0.0.0
  --dashboard-port="$DASHBOARD_PORT"
  --metrics-export-port="$METRICS_PORT"
  --min-worker-port="$MIN_WORKER_PORT"
  --max-worker-port="$MAX_WORKER_PORT"
  "${GPU_ARGS[@]}"
)
[[ -z "$NUM_CPUS" ]] || ARGS+=(--num-cpus="$NUM_CPUS")
[[ -z "$OBJECT_STORE" ]] || ARGS+=(--object-store-memory="$OBJECT_STORE")
ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})

# before Ray: only processes started after the daemon become its clients
if [[ $MPS == 1 || ( $MPS == auto && -n "$GPU_SPEC" ) ]]; then start_mps; fi
serve_settings
run env "${GPU_ENV[@]}" "$RAY_BIN" start "${ARGS[@]}"

if [[ $DRY_RUN -eq 0 ]]; then
  host="$(hostname -I 2>/dev/null | awk '{print $1}')"
  host="${host:-127.0.0.1}"
  cat <<EOF
start_head.sh: head started.
  GPUs join with:  cluster/start_workers.sh --address ${host}:${PORT}
  dashboard:       http://${host}:${DASHBOARD_PORT}   (Serve tab; \`serve deploy\` uses it)
  metrics:         http://${host}:${METRICS_PORT}/metrics
EOF
fi
