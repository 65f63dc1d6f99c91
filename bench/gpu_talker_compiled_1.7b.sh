#!/usr/bin/env bash
# GPU run: 1.7B talker step with torch.compile'd kernels inside the CUDA graphs (graph vs plain eager check).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
W=/tmp/qwen3-tts-bench
python3 -m stages.checkpoint random $W/1.7b-custom_voice --size 1.7b --kind custom_voice --device cuda > /dev/null
python3 -m bench.talker --checkpoint $W/1.7b-custom_voice --size 1.7b --steps 30 --compile --check-graphs \
    --batches 1,8,32,64,128,256,512 --out "$OUT/talker_1.7b_compiled.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/talker_1.7b_compiled.log"
