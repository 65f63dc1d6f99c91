#!/usr/bin/env bash
# GPU run: talker step with torch.compile'd kernels inside the CUDA graphs, and full-size parity.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/oracle_site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/main_site .whl/soxr-*.whl .whl/soundfile-*.whl .whl/cffi-*.whl .whl/pycparser-*.whl
export PYTHONPATH=/tmp/main_site:${PYTHONPATH:-}
W=/tmp/qwen3-tts-bench
python3 -m stages.checkpoint random $W/1.7b-custom_voice --size 1.7b --kind custom_voice --device cuda > /dev/null
python3 -m bench.talker --checkpoint $W/1.7b-custom_voice --size 1.7b --steps 30 --compile --check-graphs \
    --out "$OUT/talker_1.7b_compiled.json" 2>&1 | grep -v -i warn | tee "$OUT/talker_1.7b_compiled.log"
PYTHONPATH_ORACLE=/tmp/oracle_site python3 -m bench.parity_gpu --checkpoint $W/1.7b-custom_voice \
    --out "$OUT/parity_1.7b.json" 2>&1 | grep -v -i warn | tail -8 | tee "$OUT/parity.log"
python3 -m stages.checkpoint random $W/0.6b-custom_voice --size 0.6b --kind custom_voice --device cuda > /dev/null
python3 -m bench.talker --checkpoint $W/0.6b-custom_voice --size 0.6b --steps 30 --compile \
    --out "$OUT/talker_0.6b_compiled.json" 2>&1 | grep -v -i warn | tee "$OUT/talker_0.6b_compiled.log"
