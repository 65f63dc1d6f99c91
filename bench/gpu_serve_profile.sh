#!/usr/bin/env bash
# Where does the served Talker lose time? (issues 10 and 11). On the GPU machine, repo root, .gpubundle carried:
# starts the server (runbook setup), then per concurrency C in $LEVELS (default $C, 256) drives a closed loop and,
# while it runs, reads the engine's own step statistics (bench.serve_engine_stats: step time, mean batch, to
# compare with bench/pipeline.py's in-process step at the same batch) and records py-spy profiles of the Talker
# replica: --gil (who holds the GIL) and --idle (where every thread is, waiting included), and the busy threads
# of the Code2Wav replica and of one ingress replica. Every window lies inside the load: C x 30 requests, cut at
# LOAD_S seconds (default 24; the windows end 20 s in).
# PYSPY=0: the engines' statistics alone (py-spy sampling slows the replicas it attaches to).
# DIRECT=1: HAProxy straight to the ingress replicas + throughput-optimized Serve, 4 ingress replicas (the
# served configuration of docs/results/serving_path_h100.json); MPS=1: the CUDA MPS daemon runs meanwhile.
# Results in $OUT/<C>/: load.log, served_engine_stats.json, talker_gil.txt, talker_idle.txt, code2wav_busy.txt,
# ingress_busy.txt (py-spy raw), summary.txt.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"; LEVELS=${LEVELS:-${C:-256}}; W=${W:-/tmp/qwen3-serve-bench}
LOAD_S=${LOAD_S:-24}
source .gpubundle/install_bundle.sh .gpubundle >/dev/null 2>&1
if [ "${DIRECT:-0}" = 1 ]; then
  export RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_HA_PROXY=1
  export SET="${SET:+$SET }ingress.deployment_config.autoscaling_config.min_replicas=4"
fi
if [ "${MPS:-0}" = 1 ]; then nvidia-cuda-mps-control -d && echo "MPS control daemon started"; fi
BUDGET_S=300 OUT="$OUT" bash bench/gpu_serve_runbook.sh setup 2>&1 | tail -3
PID=$(pgrep -f "ServeReplica:tts:Talker" | head -1)
C2W=$(pgrep -f "ServeReplica:tts:Code2Wav" | head -1); ING=$(pgrep -f "ServeReplica:tts:TTSIngress" | head -1)
echo "replica pids: talker $PID, code2wav $C2W, ingress $ING"
for C in ${LEVELS//,/ }; do
  D="$OUT/$C"; mkdir -p "$D"
  python3 -m bench.loadgen --url http://127.0.0.1:8000 --mode closed --concurrency "$C" --requests $((C * 30)) \
    --max-new-tokens 75 --fixed-length --warmup 0 --timeout 300 --max-seconds "$LOAD_S" --progress none \
    --out "$W/profile_load_$C" > "$D/load.log" 2>&1 &
  LOAD=$!
  sleep 6
  python3 -m bench.serve_engine_stats --seconds 8 --out "$D/served_engine_stats.json" > "$D/stats.log" 2>&1 &
  STATS=$!
  if [ "${PYSPY:-1}" = 1 ]; then
    py-spy record --threads -r 100 -d 8 -f raw -o "$D/code2wav_busy.txt" -p "$C2W" >/dev/null 2>&1 &
    py-spy record --threads -r 100 -d 8 -f raw -o "$D/ingress_busy.txt" -p "$ING" >/dev/null 2>&1 &
    py-spy record --gil --threads -r 100 -d 8 -f raw -o "$D/talker_gil.txt" -p "$PID" >/dev/null 2>&1
    py-spy record --idle --threads -r 100 -d 6 -f raw -o "$D/talker_idle.txt" -p "$PID" >/dev/null 2>&1
  fi
  wait "$STATS"; wait "$LOAD"
  { echo "== c=$C"; grep -E "^closed" "$D/load.log"; cat "$D/served_engine_stats.json" 2>/dev/null || tail -3 "$D/stats.log"
    echo
    python3 - "$D" <<'PY'
import collections, re, sys
out = sys.argv[1]
for name, seconds in (("talker_gil.txt", 8), ("talker_idle.txt", 6), ("code2wav_busy.txt", 8),
                      ("ingress_busy.txt", 8)):
    by_thread, by_leaf, total = collections.Counter(), collections.Counter(), 0
    try:
        lines = open(f"{out}/{name}").readlines()
    except OSError:
        print(f"{name}: missing"); continue
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        thread = re.sub(r"\(\d+\)|0x[0-9a-f]+", "", frames[0]).strip()
        by_thread[thread] += int(n); total += int(n)
        by_leaf[(thread, ";".join(f.split(" (")[0] for f in frames[-3:]))] += int(n)
    print(f"{name}: {total} samples at 100 Hz over {seconds} s ({total / (100 * seconds):.0%} of wall)")
    for t, n in by_thread.most_common(5):
        print(f"  {n / (100 * seconds):6.1%}  {t}")
        for (t2, leaf), m in by_leaf.most_common():
            if t2 == t and m >= n * 0.08:
                print(f"           {m / (100 * seconds):6.1%}  {leaf[-160:]}")
PY
  } | tee "$D/summary.txt"
done
BUDGET_S=60 OUT="$OUT" bash bench/gpu_serve_runbook.sh stop >/dev/null 2>&1
if [ "${MPS:-0}" = 1 ]; then echo quit | nvidia-cuda-mps-control; fi
