#!/usr/bin/env bash
# GPU run for issue 12's peer comparison: faster-qwen3-tts 0.5.4 and our Talker, batch 1, ms per frame, on the same
# random 1.7B CustomVoice checkpoint in one call. On the GPU machine, from the repo root, with .whl carried:
#   bash bench/gpu_peer.sh [STEP ...]          (default: peer talker)
# peer: python -m bench.peer_faster_qwen3_tts (its CUDA-graph path, EOS held off by its own min_new_tokens; docstring
# there) with the peer's wheels from .whl/peer/ (+ soundfile, soxr, cffi, pycparser from .whl/) in /tmp/site, on
# PYTHONPATH for this step only (.whl/peer/ is a subfolder so that the `.whl/*.whl` installs of other scripts never
# pick up qwen-tts-hf's `qwen_tts`, which would shadow the official oracle's).
# talker: ours, python -m bench.talker --batches 1 --compile (talker_profile's settings in gpu_frame_speed.sh,
# without the profiler).
# The wheels (here, once; pure Python, ~0.6 MB; the GPU image has torch, transformers 5.17 and the rest):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl/peer \
#     faster-qwen3-tts==0.5.4 qwen-tts-hf==0.1.1.post1 librosa==0.11.0 pooch==1.9.0 sox==1.4.1 \
#     platformdirs==4.14.5 audioread==3.1.0 decorator==5.2.1
#   (and soundfile, soxr, cffi, pycparser into .whl/ as docs/benchmarks.md says for the oracle)
# CKPT=dir reuses a checkpoint; otherwise it is written as gpu_frame_speed.sh writes it ($W/1.7b-custom_voice, so
# a call running both scripts writes it once). FRAMES (per peer run, 200), RUNS (5), STEPS_OURS (bench.talker's
# timed steps, 30). Results (logs, JSON) land in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
W=${W:-.gpucache}; CKPT=${CKPT:-$W/1.7b-custom_voice}
STEPS=${*:-peer talker}
FRAMES=${FRAMES:-200}; RUNS=${RUNS:-5}; STEPS_OURS=${STEPS_OURS:-30}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
checkpoint() {
  if [ ! -f "$CKPT/config.json" ]; then
    python3 -m stages.checkpoint random "$CKPT" --size 1.7b --kind custom_voice --device cuda 2>&1 | tail -2
  fi
}
for step in $STEPS; do
  case $step in
    peer) checkpoint
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/peer/*.whl .whl/soundfile-*.whl .whl/soxr-*.whl .whl/cffi-*.whl .whl/pycparser-*.whl \
            || { echo "peer: wheel install failed (carry .whl with .whl/peer/)"; exit 3; }
          python3 -m pip show torch transformers huggingface-hub accelerate torchaudio onnxruntime numba 2>/dev/null \
            | grep -E "^(Name|Version)" | paste - - > "$OUT/peer_env.txt"
          PYTHONPATH=/tmp/site:${PYTHONPATH:-} python3 -m bench.peer_faster_qwen3_tts --checkpoint "$CKPT" \
            --frames "$FRAMES" --runs "$RUNS" --json "$OUT/peer_faster_qwen3_tts.json" 2>&1 \
            | tee "$OUT/peer_faster_qwen3_tts.log" | grep -E "^\[peer\]|^\{|Error|error:|Traceback|CUDA" | tail -16 ;;
    talker) checkpoint
          python3 -m bench.talker --checkpoint "$CKPT" --batches 1 --steps "$STEPS_OURS" --compile \
            --max-seq-len 1024 --out "$OUT/talker_b1.json" 2>&1 | tee "$OUT/talker_b1.log" \
            | grep -vE "^\[talker\] captured" | tail -8 ;;
  esac
  echo "$step done +$(( $(date +%s) - t0 ))s"
done
