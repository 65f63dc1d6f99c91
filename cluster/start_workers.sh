#!/usr/bin/env bash
# Join this host's GPUs to a Ray cluster as one raylet per GPU, each advertising its own custom
# resource (gpu_<k> by default), so a deployment asking for `resources: {gpu_k: ...}` lands on GPU k.
# Custom resources on one multi-GPU raylet do not choose a device index; one raylet per GPU does.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: cluster/start_workers.sh --address HEAD_HOST:PORT [options] [-- extra `ray start` arguments]

Start one raylet per GPU on this host:
  CUDA_VISIBLE_DEVICES=k ray start --address=HEAD --num-gpus=1 --resources '{"gpu_k": 1}'
A deployment with `ray_actor_options: {num_gpus: 1, resources: {gpu_k: 1}}` (configs/split.yaml:
Talker on gpu_0, Code2Wav on gpu_1) then runs on GPU k, and only there.

Options:
  --address HOST:PORT          the head's GCS address (required; e.g. 127.0.0.1:6379 on one box)
  --gpus LIST                  device indices, e.g. 0,1 (default: $CUDA_VISIBLE_DEVICES if set, else
                               every GPU nvidia-smi lists)
  --names LIST                 custom resource of each GPU, same order, e.g. gpu_0,gpu_0,gpu_1,gpu_1
                               to give the Talker two GPUs (default: gpu_<index>; under the cluster
                               launcher: the gpu_* resources of the node type, RAY_OVERRIDE_RESOURCES)
  --cpus-per-gpu N             logical CPUs per raylet (default: the host's CPUs / number of GPUs)
  --object-store-memory BYTES  object store per raylet (default: Ray's with one GPU, else 30% of
                               RAM / number of GPUs)
  --worker-ports MIN-MAX       worker ports, split evenly between the raylets (default 11000-19999;
                               start_head.sh uses 10002-10999)
  --agent-port-base P          raylet i serves its dashboard agent on P+i (default 52366)
  --metrics-port-base P        raylet i exports Prometheus metrics on P+i (default 8081)
  --restart                    `ray stop` first: stops EVERY Ray process on this host, head included
  --mps                        require the CUDA MPS control daemon (nvidia-cuda-mps-control -d): started
                               before Ray unless one runs, an error if the binary is missing. Without
                               it MPS starts whenever the binary exists: replicas sharing
                               a GPU overlap their kernels (docs/serving.md, "CUDA MPS"); --stop quits it
  --no-mps                     never start (or quit) the MPS control daemon
  --stop                       `ray stop` and exit (safe to repeat)
  --dry-run                    print the commands, run nothing
  -h, --help                   this text

A GPU that already has a raylet of this cluster on this host is skipped: running the script twice
is harmless.

Environment: RAY (the ray executable, default `ray`). RAY_SERVE_THROUGHPUT_OPTIMIZED and
RAY_SERVE_ENABLE_HA_PROXY default to 1 (the fastest measured Serve settings; set 0 to opt out).

Examples:
  cluster/start_workers.sh --address 127.0.0.1:6379 --gpus 0,1          # split.yaml on one box
  cluster/start_workers.sh --address 10.0.0.5:6379 --gpus 0,1,2,3 --names gpu_0,gpu_0,gpu_1,gpu_1
EOF
}

die() { echo "start_workers.sh: $*" >&2; exit 2; }

RAY_BIN="${RAY:-ray}"
ADDRESS=""
GPUS=""
NAMES=""
CPUS_PER_GPU=""
OBJECT_STORE=""
WORKER_PORTS="11000-19999"
AGENT_PORT_BASE=52366
METRICS_PORT_BASE=8081
RESTART=0
STOP=0
MPS=auto
DRY_RUN=0
EXTRA=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --address) ADDRESS="${2:?--address needs a value}"; shift 2 ;;
    --address=*) ADDRESS="${1#*=}"; shift ;;
    --gpus) GPUS="${2:?--gpus needs a value}"; shift 2 ;;
    --names) NAMES="${2:?--names needs a value}"; shift 2 ;;
    --cpus-per-gpu) CPUS_PER_GPU="${2:?--cpus-per-gpu needs a value}"; shift 2 ;;
    --object-store-memory) OBJECT_STORE="${2:?--object-store-memory needs a value}"; shift 2 ;;
    --worker-ports) WORKER_PORTS="${2:?--worker-ports needs a value}"; shift 2 ;;
    --agent-port-base) AGENT_PORT_BASE="${2:?--agent-port-base needs a value}"; shift 2 ;;
    --metrics-port-base) METRICS_PORT_BASE="${2:?--metrics-port-base needs a value}"; shift 2 ;;
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

# shellcheck source=cluster/_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/_common.sh"

if [[ $STOP -eq 1 ]]; then
  run "$RAY_BIN" stop
  [[ $MPS == 0 ]] || stop_mps
  exit 0
fi

is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }
[[ -n "$ADDRESS" ]] || { usage >&2; die "--address HEAD_HOST:PORT is required"; }
[[ "$ADDRESS" =~ ^[^:[:space:]]+:[0-9]+$ ]] || die "--address must be HOST:PORT, got '$ADDRESS'"
[[ -z "$CPUS_PER_GPU" ]] || is_uint "$CPUS_PER_GPU" || die "--cpus-per-gpu must be a number"
[[ -z "$OBJECT_STORE" ]] || is_uint "$OBJECT_STORE" || die "--object-store-memory must be bytes"
is_uint "$AGENT_PORT_BASE" || die "--agent-port-base must be a number"
is_uint "$METRICS_PORT_BASE" || die "--metrics-port-base must be a number"
[[ "$WORKER_PORTS" =~ ^([0-9]+)-([0-9]+)$ ]] || die "--worker-ports must be MIN-MAX, got '$WORKER_PORTS'"
MIN_WORKER_PORT="${BASH_REMATCH[1]}"
MAX_WORKER_PORT="${BASH_REMATCH[2]}"

# ---- which GPUs
if [[ -z "$GPUS" && -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
  GPUS="$CUDA_VISIBLE_DEVICES"
fi
if [[ -z "$GPUS" ]]; then
  command -v nvidia-smi >/dev/null 2>&1 || die "no --gpus given and nvidia-smi not found"
  GPUS="$(nvidia-smi --query-gpu=index --format=csv,noheader | tr -d ' ' | paste -sd, -)"
  [[ -n "$GPUS" ]] || die "nvidia-smi lists no GPU"
fi
IFS=, read -r -a GPU_LIST <<< "$GPUS"
for k in "${GPU_LIST[@]}"; do
  is_uint "$k" || die "--gpus must be device indices like 0,1, got '$GPUS'"
done
N=${#GPU_LIST[@]}
(( N > 0 )) || die "no GPU to start"

# ---- the custom resource of each GPU
OVERRIDE="${RAY_OVERRIDE_RESOURCES:-}"   # set by the cluster launcher from the node type's `resources`
OVERRIDE_CPUS=""
if [[ -n "$OVERRIDE" ]]; then
  # gpu_* names (sorted by index) and CPU of the node type
  parsed="$(python3 -c '
import json, re, sys
r = json.loads(sys.argv[1])
names = sorted((k for k in r if re.fullmatch(r"gpu_[0-9]+", k)), key=lambda k: int(k[4:]))
print(",".join(n for n in names for _ in range(int(r[n]))))
print(int(r["CPU"]) if "CPU" in r else "")
' "$OVERRIDE")" || die "cannot parse RAY_OVERRIDE_RESOURCES='$OVERRIDE'"
  { read -r OVERRIDE_NAMES; read -r OVERRIDE_CPUS; } <<< "$parsed"
  [[ -n "$NAMES" ]] || NAMES="$OVERRIDE_NAMES"
fi
if [[ -z "$NAMES" ]]; then
  NAMES="$(printf 'gpu_%s,' "${GPU_LIST[@]}")"
  NAMES="${NAMES%,}"
fi
IFS=, read -r -a NAME_LIST <<< "$NAMES"
(( ${#NAME_LIST[@]} == N )) || die "${#NAME_LIST[@]} names (${NAMES}) for ${N} GPUs (${GPUS})"
for name in "${NAME_LIST[@]}"; do
  [[ "$name" =~ ^[A-Za-z_][A-Za-z0-9_.-]*$ ]] || die "bad resource name '$name'"
done

# ---- each raylet's share of the host
if [[ -z "$CPUS_PER_GPU" ]]; then
  total_cpus="${OVERRIDE_CPUS:-$(nproc)}"
  CPUS_PER_GPU=$(( total_cpus / N ))
  (( CPUS_PER_GPU >= 1 )) || CPUS_PER_GPU=1
fi
if [[ -z "$OBJECT_STORE" && $N -gt 1 ]]; then
  mem_kb="$(awk '/^MemTotal:/ {print $2}' /proc/meminfo)"
  OBJECT_STORE=$(( mem_kb * 1024 * 3 / 10 / N ))
fi
PORT_SPAN=$(( (MAX_WORKER_PORT - MIN_WORKER_PORT + 1) / N ))
(( PORT_SPAN >= 32 )) || die "--worker-ports $WORKER_PORTS is too narrow for $N raylets"

# ---- idempotency: a raylet of this cluster (same GCS port) started for GPU k carries
# CUDA_VISIBLE_DEVICES=k in its environment
GCS_PORT="${ADDRESS##*:}"
RUNNING_GPUS=" "
if [[ $RESTART -eq 1 ]]; then
  run "$RAY_BIN" stop
else
  for dir in /proc/[0-9]*; do
    comm=""
    { read -r comm < "$dir/comm"; } 2>/dev/null || continue
    [[ "$comm" == raylet ]] || continue
    # grep -c reads all its input (no SIGPIPE for tr under pipefail); no match: another cluster
    tr '\0' '\n' < "$dir/cmdline" 2>/dev/null | grep -c -- "^--gcs-address=.*:${GCS_PORT}\$" >/dev/null || continue
    cvd="$(tr '\0' '\n' < "$dir/environ" 2>/dev/null | sed -n 's/^CUDA_VISIBLE_DEVICES=//p')" || true
    [[ -z "$cvd" ]] || RUNNING_GPUS+="$cvd "
  done
fi

started=0
for i in "${!GPU_LIST[@]}"; do
  k="${GPU_LIST[$i]}"
  name="${NAME_LIST[$i]}"
  if [[ "$RUNNING_GPUS" == *" $k "* ]]; then
    echo "start_workers.sh: GPU $k already has a raylet on this host; skipped"
    continue
  fi
  [[ $started -ne 0 ]] || serve_settings
  # MPS before the first raylet it starts: only processes started after the daemon become its clients
  if [[ $MPS != 0 && $started -eq 0 ]]; then start_mps; fi
  lo=$(( MIN_WORKER_PORT + i * PORT_SPAN ))
  hi=$(( lo + PORT_SPAN - 1 ))
  args=(
    start
    --address="$ADDRESS"
    --num-gpus=1
    --resources "{\"${name}\": 1}"
    --num-cpus="$CPUS_PER_GPU"
    --min-worker-port="$lo"
    --max-worker-port="$hi"
    --dashboard-agent-listen-port=$(( AGENT_PORT_BASE + i ))
    --metrics-export-port=$(( METRICS_PORT_BASE + i ))
  )
  [[ -z "$OBJECT_STORE" ]] || args+=(--object-store-memory="$OBJECT_STORE")
  args+=(${EXTRA[@]+"${EXTRA[@]}"})
  # the raylet's resources are exactly the ones above: drop the launcher's node-wide override
  run env -u RAY_OVERRIDE_RESOURCES "CUDA_VISIBLE_DEVICES=$k" "$RAY_BIN" "${args[@]}"
  started=$(( started + 1 ))
done

echo "start_workers.sh: ${started} raylet(s) started, $(( N - started )) already running (GPUs ${GPUS} -> ${NAMES})"
