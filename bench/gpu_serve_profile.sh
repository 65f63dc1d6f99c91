#!/usr/bin/env bash
# Where does the served Talker lose time? (issue 10, "where the engine loop runs"). On the GPU machine, repo
# root, .gpubundle carried: starts the server (runbook setup), drives a closed loop at C streams, and while it
# runs reads the engine's own step statistics (bench.serve_engine_stats) and records py-spy profiles of the
# Talker replica: --gil (who holds the GIL) and --idle (where every thread is, waiting included), and the busy
# threads of the Code2Wav replica and of one ingress replica.
set -uo pipefail
OUT=${OUT:-bench/out}; mkdir -p "$OUT"; C=${C:-256}; W=${W:-/tmp/qwen3-serve-bench}
source .gpubundle/install_bundle.sh .gpubundle >/dev/null 2>&1
BUDGET_S=300 OUT="$OUT" bash bench/gpu_serve_runbook.sh setup 2>&1 | tail -3
PID=$(pgrep -f "ServeReplica:tts:Talker" | head -1)
echo "talker replica pid: $PID"
# enough requests that the load outlasts the 8 s stats window that starts 6 s in (at c=256, 4 x C ended at ~11 s
# on an H100, and the window's idle tail made the step time meaningless)
python3 -m bench.loadgen --url http://127.0.0.1:8000 --mode closed --concurrency "$C" --requests $((C * 10)) \
  --max-new-tokens 75 --fixed-length --warmup 0 --timeout 300 --progress none --out "$W/profile_load" \
  > "$OUT/load.log" 2>&1 &
LOAD=$!
sleep 6
python3 -m bench.serve_engine_stats --seconds 8 --out "$OUT/served_engine_stats.json" 2>/dev/null &
# meanwhile: the busy threads (no --idle) of the Code2Wav replica and of one ingress replica
C2W=$(pgrep -f "ServeReplica:tts:Code2Wav" | head -1); ING=$(pgrep -f "ServeReplica:tts:TTSIngress" | head -1)
py-spy record --threads -r 100 -d 8 -f raw -o "$OUT/code2wav_busy.txt" -p "$C2W" >/dev/null 2>&1 &
py-spy record --threads -r 100 -d 8 -f raw -o "$OUT/ingress_busy.txt" -p "$ING" >/dev/null 2>&1 &
py-spy record --gil --threads -r 100 -d 8 -f raw -o "$OUT/talker_gil.txt" -p "$PID" >/dev/null 2>&1
py-spy record --idle --threads -r 100 -d 6 -f raw -o "$OUT/talker_idle.txt" -p "$PID" >/dev/null 2>&1
wait "$LOAD"
tail -3 "$OUT/load.log"; cat "$OUT/served_engine_stats.json"
python3 - "$OUT" <<'PY'
import collections, re, sys
out = sys.argv[1]
for name, seconds in (("talker_gil.txt", 8), ("talker_idle.txt", 6), ("code2wav_busy.txt", 8),
                      ("ingress_busy.txt", 8)):
    by_thread, total = collections.Counter(), 0
    for line in open(f"{out}/{name}"):
        stack, _, n = line.rstrip().rpartition(" ")
        thread = stack.split(";")[0]
        by_thread[re.sub(r"\(\d+\)|0x[0-9a-f]+", "", thread).strip()] += int(n); total += int(n)
    print(f"{name}: {total} samples at 100 Hz over {seconds} s ({total / (100 * seconds):.0%} of wall)")
    for t, n in by_thread.most_common(6):
        print(f"  {n / (100 * seconds):6.1%}  {t}")
PY
