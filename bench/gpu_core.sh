#!/usr/bin/env bash
# GPU run for the model core and the talker/code2wav engines (issues 2, 3, 4). Run on the GPU machine
# from the repo root with .whl carried (oracle wheels, see docs/benchmarks.md). Results land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/oracle_site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/main_site .whl/soxr-*.whl .whl/soundfile-*.whl .whl/cffi-*.whl .whl/pycparser-*.whl
export PYTHONPATH=/tmp/main_site:${PYTHONPATH:-}
W=/tmp/qwen3-tts-bench
python3 -m stages.checkpoint random $W/1.7b-custom_voice --size 1.7b --kind custom_voice --device cuda
python3 -m bench.talker --checkpoint $W/1.7b-custom_voice --size 1.7b --steps 30 --check-graphs \
    --out "$OUT/talker_1.7b.json" 2>&1 | tee "$OUT/talker_1.7b.log"
PYTHONPATH_ORACLE=/tmp/oracle_site python3 -m bench.parity_gpu --checkpoint $W/1.7b-custom_voice \
    --out "$OUT/parity_1.7b.json" 2>&1 | tail -20 | tee "$OUT/parity.log"
python3 -m stages.checkpoint random $W/0.6b-custom_voice --size 0.6b --kind custom_voice --device cuda
python3 -m bench.talker --checkpoint $W/0.6b-custom_voice --size 0.6b --steps 30 \
    --out "$OUT/talker_0.6b.json" 2>&1 | tee "$OUT/talker_0.6b.log"
if [ -f bench/code2wav.py ]; then
  python3 -m bench.code2wav --out "$OUT" 2>&1 | tee "$OUT/code2wav.log"
fi
