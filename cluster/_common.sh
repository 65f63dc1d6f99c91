# Shared by cluster/start_head.sh and cluster/start_workers.sh (sourced, not run).

# print a command the way a shell would read it back
show() {
  local out="" arg
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then out+="$arg "; else out+="'${arg//\'/\'\\\'\'}' "; fi
  done
  echo "+ ${out% }"
}

# show a command, and run it unless DRY_RUN=1
run() {
  show "$@"
  if [[ ${DRY_RUN:-0} -eq 0 ]]; then "$@"; fi
}

# ---- The fastest measured cluster-wide Serve settings (docs/serving.md, "The fastest recipe"): every Ray process
# started by these scripts reads them; a value already in the environment wins (=0 opts out).
export RAY_SERVE_THROUGHPUT_OPTIMIZED="${RAY_SERVE_THROUGHPUT_OPTIMIZED:-1}"
export RAY_SERVE_ENABLE_HA_PROXY="${RAY_SERVE_ENABLE_HA_PROXY:-1}"
serve_settings() {
  echo "${0##*/}: RAY_SERVE_THROUGHPUT_OPTIMIZED=$RAY_SERVE_THROUGHPUT_OPTIMIZED RAY_SERVE_ENABLE_HA_PROXY=$RAY_SERVE_ENABLE_HA_PROXY"
}

# ---- CUDA MPS: one control daemon per host, started before Ray, so that the CUDA contexts of every replica on a
# GPU (the co-located Talker and Code2Wav) become clients of one MPS server and their kernels overlap instead of
# time-slicing the GPU (docs/serving.md, "CUDA MPS"). Replicas that started before the daemon are not its clients.
# MPS=auto (the default where a script starts GPU raylets): started when the control binary exists; --mps: required;
# --no-mps: never.
MPS_BIN="${MPS_CONTROL:-nvidia-cuda-mps-control}"

# is a control daemon (`nvidia-cuda-mps-control -d`) running on this host?
mps_daemon_running() {
  local dir args
  for dir in /proc/[0-9]*; do
    { mapfile -d '' -t args < "$dir/cmdline"; } 2>/dev/null || continue  # a process gone meanwhile: skipped
    if [[ ${#args[@]} -ge 2 && "${args[0]##*/}" == "${MPS_BIN##*/}" && "${args[1]}" == -d ]]; then
      return 0
    fi
  done
  return 1
}

start_mps() {
  if mps_daemon_running; then
    echo "${0##*/}: an MPS control daemon already runs on this host; left as it is"
    return 0
  fi
  if ! command -v "$MPS_BIN" >/dev/null 2>&1; then
    if [[ ${MPS:-auto} == auto ]]; then
      echo "${0##*/}: $MPS_BIN not found: GPU processes start without MPS"
      return 0
    fi
    if [[ ${DRY_RUN:-0} -eq 0 ]]; then
      echo "${0##*/}: --mps: $MPS_BIN not found (it ships with the NVIDIA driver)" >&2
      exit 2
    fi
  fi
  # every GPU of the host: a client's device numbers count within the daemon's visible devices, and the raylets
  # set their own CUDA_VISIBLE_DEVICES
  run env -u CUDA_VISIBLE_DEVICES "$MPS_BIN" -d
}

stop_mps() {
  if ! mps_daemon_running; then
    echo "${0##*/}: no MPS control daemon runs on this host"
    return 0
  fi
  show echo quit '|' "$MPS_BIN"
  if [[ ${DRY_RUN:-0} -eq 0 ]]; then echo quit | "$MPS_BIN"; fi
}
