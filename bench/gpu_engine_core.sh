#!/usr/bin/env bash
# GPU run for the talker engine core (issue 10): GPU tests of the engine paths, decode-only steps, both engines
# in one process under arrivals (policies: stateful Code2Wav, first chunk of 1 frame, each decode policy of
# $POLICIES in turn on the same engines). On the GPU machine, from the repo root, .gpubundle carried:
#   source .gpubundle/install_bundle.sh .gpubundle && bash bench/gpu_engine_core.sh [tests] [talker] [pipeline]
# Results (logs, JSON) land in $OUT. The 1.7B random checkpoint is written once into $W (kept while the
# machine stays warm).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
W=${W:-.gpucache}; CKPT=$W/1.7b-custom_voice
STEPS=${*:-tests talker pipeline}
LEVELS=${LEVELS:-1,64,256,512}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
if [ ! -f "$CKPT/config.json" ]; then
  python3 -m stages.checkpoint random "$CKPT" --size 1.7b --kind custom_voice --device cuda 2>&1 | tail -2
fi
echo "checkpoint ready +$(( $(date +%s) - t0 ))s"
for step in $STEPS; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/stages/test_talker_engine_gpu.py 2>&1 \
             | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error|max abs err|Error|assert" | tail -30 ;;
    talker) python3 -m bench.talker --checkpoint "$CKPT" --batches ${BATCHES:-1,64,256,512} --steps 30 --compile \
              --max-seq-len 1024 --out "$OUT/talker.json" 2>&1 | tee "$OUT/talker.log" | grep -vE "^\[talker\] captured" | tail -14 ;;
    pipeline) python3 -m bench.pipeline --checkpoint "$CKPT" --levels "$LEVELS" --compile --slots 512 \
                --first-chunk-frames ${FIRST_CHUNK:-2} --out "$OUT/pipeline.json" 2>&1 | tee "$OUT/pipeline.log" \
                | grep -vE "^\[talker\] captured" | tail -9 ;;
    policies) python3 -m bench.pipeline --checkpoint "$CKPT" --levels "$LEVELS" --per-level ${PER_LEVEL:-4} --compile \
                --slots 512 --first-chunk-frames 1 --stateful-code2wav --decode-policies "${POLICIES:-deadline:256:2048}" \
                --out "$OUT/pipeline_policies.json" 2>&1 | tee "$OUT/pipeline_policies.log" \
                | grep -vE "^\[talker\] captured|^\[code2wav\] captured" | tail -30 ;;
    talker_only) python3 -m bench.pipeline --checkpoint "$CKPT" --levels "${TALKER_LEVELS:-256,512}" --compile \
                   --slots 512 --no-code2wav --out "$OUT/pipeline_talker_only.json" 2>&1 \
                   | tee "$OUT/pipeline_talker_only.log" | tail -5 ;;
    first1) python3 -m bench.pipeline --checkpoint "$CKPT" --levels 1 --min-requests 16 --compile --slots 512 \
              --first-chunk-frames 1 --out "$OUT/pipeline_first1.json" 2>&1 | tee "$OUT/pipeline_first1.log" | tail -4
            python3 -m bench.pipeline --checkpoint "$CKPT" --levels 1 --min-requests 16 --compile --slots 512 \
              --first-chunk-frames 1 --no-code2wav --out "$OUT/pipeline_first1_talker_only.json" 2>&1 | tail -3 ;;
  esac
  echo "$step done +$(( $(date +%s) - t0 ))s"
done
