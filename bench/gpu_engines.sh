#!/usr/bin/env bash
# The engine-level GPU runbook: the engines alone and together in one process, no Ray. On the GPU machine, from the
# repo root:
#   bash bench/gpu_engines.sh [STEP ...]          (default: tests code2wav pipeline)
# tests: stateful + stateless Code2Wav GPU tests; talker_tests: talker engine + sampler GPU tests (kernels vs
# references, graphed == reference, no host sync, a seeded request alone and in batches of 64 and 256);
# code2wav: bench.code2wav stateless then --stateful;
# c2w_tuned: --stateful --cudnn-benchmark --profile; talker_profile: bench.talker b1/b256 with the profiler;
# pipeline / pipeline_stateless: both engines in one process, stateful / stateless Code2Wav.
# gemv: the few-row Triton GEMVs' GPU tests and their tiling sweep against cuBLAS (bench.kernels.gemv); talker_gemv:
# bench.talker --profile per VARIANT (default "4hs 4hsa": --gemv-rows N, "h" adding --heads-in-attention,
# "s" --sampling-kernel, "p" --pdl, "a" --attention-splits; a letter left out passes --no-...), "4hs"
# being the default step.
# attention: bench.kernels.paged_attention, the decode-attention tiling sweep in CUDA graphs, and the splits sweep at a few rows (1-32 programs per row and KV head, 160-2000 keys).
# select: bench.kernels.select, token selection per call (compiled sort, the sampling kernel).
# KERNEL_FLAGS (e.g. "--pdl") go to talker_check, talker_profile, talker_before and pipeline.
# talker_check: bench.talker --check-graphs per batch bucket (graph + compiled + fused vs eager: the first step's
# codebook-0 logits and codes, then steps equal).
# c2w_stateful: bench.code2wav --stateful --profile (the serving configs' engine); c2w_before: the same with an
# earlier tree (BEFORE, as for talker_before).
# talker_before: talker_profile with an earlier tree (BEFORE=a tar.gz of `git archive <commit> stages bench`,
# carried), same checkpoint and call: the before/after of a kernel change.
# startup: bench.startup twice (the engines' start phase by phase, high_concurrency.yaml's engine config): cold
# (empty Inductor/Triton caches and compile-cache dir), then from the compile-cache dir alone (the file and the
# Triton cache the replicas keep beside it; Inductor's cache deleted: a new machine sharing the serve home's cache
# dir); both under py-spy if PYSPY=path/to/py-spy; the cold one with --profile (where its compile time went, in
# startup_cold.json: the project's Triton kernels, Inductor's autotuning, Dynamo's phases).
# No Ray needed (nothing to carry). Results (logs, JSON) land in $OUT; the random 1.7B checkpoint in $W.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
OUT=${OUT:-bench/out}; mkdir -p "$OUT"
W=${W:-.gpucache}; CKPT=$W/1.7b-custom_voice
STEPS=${*:-tests code2wav pipeline}
LEVELS=${LEVELS:-1,64,256}
C2W_BATCHES=${C2W_BATCHES:-32,64,128,256}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
t0=$(date +%s)
checkpoint() {
  if [ ! -f "$CKPT/config.json" ]; then
    python3 -m stages.checkpoint random "$CKPT" --size 1.7b --kind custom_voice --device cuda 2>&1 | tail -2
  fi
}
for step in $STEPS; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/stages/test_code2wav_stateful.py \
             tests/stages/test_code2wav_engine.py 2>&1 | tee "$OUT/gpu_tests.log" \
             | grep -E "passed|failed|error|max diff|Error|assert" | tail -24 ;;
    talker_tests) python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/stages/gpu/test_talker_engine_gpu.py tests/stages/gpu/test_gemv_gpu.py \
             tests/stages/gpu/test_sampling_gpu.py tests/stages/gpu/test_pdl_gpu.py \
             tests/stages/gpu/test_seeded_determinism.py 2>&1 | tee "$OUT/talker_gpu_tests.log" \
             | grep -E "passed|failed|error|max abs err|Error|assert" | tail -24 ;;
    code2wav) python3 -m bench.code2wav --batches "$C2W_BATCHES" --seconds 1 --first 1 --out "$OUT/c2w_stateless" \
                2>&1 | tee "$OUT/c2w_stateless.log" | grep -E "^batch|latency|streams|best" | tail -8
              python3 -m bench.code2wav --batches "$C2W_BATCHES" --seconds 1 --first 1 --stateful \
                --out "$OUT/c2w_stateful" 2>&1 | tee "$OUT/c2w_stateful.log" | grep -E "^batch|latency|best|captured in" | tail -9 ;;
    c2w_stateful) python3 -m bench.code2wav --batches "$C2W_BATCHES" --seconds 1 --first 1 --stateful --profile \
                --out "$OUT/c2w_stateful" 2>&1 | tee "$OUT/c2w_stateful.log" | grep -E "^batch|latency|best|captured in|^\|" \
                | tail -24 ;;
    c2w_before) rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf "${BEFORE:-.before.tar.gz}" -C /tmp/before
              (cd /tmp/before && python3 -m bench.code2wav --batches "$C2W_BATCHES" --seconds 1 --first 1 --stateful \
                --profile --out /tmp/before/c2w) 2>&1 | tee "$OUT/c2w_before.log" \
                | grep -E "^batch|latency|best|captured in|^\|" | tail -24
              mkdir -p "$OUT/c2w_before" && cp -r /tmp/before/c2w/. "$OUT/c2w_before/" ;;
    c2w_tuned) python3 -m bench.code2wav --batches "$C2W_BATCHES" --seconds 1 --first 1 --stateful --cudnn-benchmark \
                 --profile --out "$OUT/c2w_stateful_tuned" 2>&1 | tee "$OUT/c2w_stateful_tuned.log" \
                 | grep -E "^batch|best|captured in" | tail -6 ;;
    talker_profile) checkpoint
              python3 -m bench.talker --checkpoint "$CKPT" --batches ${BATCHES:-1,256} --steps 30 --compile \
                --max-seq-len 1024 --profile ${KERNEL_FLAGS:-} --out "$OUT/talker_profile.json" 2>&1 | tee "$OUT/talker_profile.log" \
                | grep -vE "^\[talker\] captured|^\{" | tail -40 ;;
    gemv) python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/stages/gpu/test_gemv_gpu.py 2>&1 \
             | tee "$OUT/gemv_gpu_tests.log" | grep -E "passed|failed|error|max abs err|Error|assert" | tail -40
          python3 -m bench.kernels.gemv --rows ${GEMV_ROWS_SWEEP:-1} --out "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.log" | tail -20 ;;
    attention) python3 -m bench.kernels.paged_attention --out "$OUT/paged_attention.json" 2>&1 | tee "$OUT/paged_attention.log" \
                 | grep -E "^batch|^contiguous|^splits|Error" | tail -30 ;;
    select) python3 -m bench.kernels.select --out "$OUT/select.json" 2>&1 | tee "$OUT/select.log" | grep -E "^batch|Error" | tail -12 ;;
    talker_gemv) checkpoint  # the decode step: layers on cuBLAS / on the GEMVs, heads in compiled kernels / in attention
              for v in ${VARIANTS:-4hs 4hsa}; do
                python3 -m bench.talker --checkpoint "$CKPT" --batches ${BATCHES:-1,2,4,256} --steps 30 --compile \
                  --max-seq-len 1024 --gemv-rows ${v//[^0-9]/} $([[ $v == *h* ]] && echo --heads-in-attention || echo --no-heads-in-attention) \
                  $([[ $v == *s* ]] && echo --sampling-kernel || echo --no-sampling-kernel) $([[ $v == *p* ]] && echo --pdl || echo --no-pdl) \
                  $([[ $v == *a* ]] && echo --attention-splits || echo --no-attention-splits) --profile --out "$OUT/talker_$v.json" 2>&1 \
                  | tee "$OUT/talker_$v.log" | grep -vE "^\[talker\] captured|^\{" | tail -30
              done ;;
    talker_check) checkpoint  # graphed + compiled + fused against eager, per batch bucket (first-step logits, codes)
              python3 -m bench.talker --checkpoint "$CKPT" --batches ${CHECK_BATCHES:-1,8,64,256} --steps 20 --compile \
                --max-seq-len 1024 --check-graphs ${KERNEL_FLAGS:-} --out "$OUT/talker_check.json" 2>&1 \
                | tee "$OUT/talker_check.log" \
                | grep -E "^\{" | tail -8 ;;
    talker_before) checkpoint
              rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf "${BEFORE:-.before.tar.gz}" -C /tmp/before
              CK=$(cd "$CKPT" && pwd)
              (cd /tmp/before && python3 -m bench.talker --checkpoint "$CK" --batches ${BATCHES:-1,256} --steps 30 \
                --compile --max-seq-len 1024 --profile ${KERNEL_FLAGS:-} --out /tmp/before/talker_profile.json) 2>&1 \
                | tee "$OUT/talker_before.log" | grep -vE "^\[talker\] captured|^\{" | tail -40
              cp /tmp/before/talker_profile.json "$OUT/talker_before.json" ;;
    startup) checkpoint
              S=/tmp/startup; rm -rf $S; mkdir -p $S
              # Triton's cache under the compile-cache dir, as the replicas keep it (deployments/constants.py)
              export TORCHINDUCTOR_CACHE_DIR=$S/inductor TRITON_CACHE_DIR=$S/cc/triton
              ${PYSPY:+$PYSPY record -r 50 --format speedscope -o "$OUT/startup_cold.speedscope" --} \
                python3 -m bench.startup --checkpoint "$CKPT" --compile-cache-dir $S/cc --profile \
                --out "$OUT/startup_cold.json" \
                2>&1 | tee "$OUT/startup_cold.log" | grep -E "^\[\+|^\{" | grep -vE "captured [0-9]+/" | tail -30
              rm -rf $S/inductor
              ${PYSPY:+$PYSPY record -r 50 --format speedscope -o "$OUT/startup_cached.speedscope" --} \
                python3 -m bench.startup --checkpoint "$CKPT" --compile-cache-dir $S/cc --out "$OUT/startup_cached.json" \
                2>&1 | tee "$OUT/startup_cached.log" | grep -E "^\[\+|^\{" | grep -vE "captured [0-9]+/" | tail -30
              unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR ;;
    pipeline) checkpoint
              python3 -m bench.pipeline --checkpoint "$CKPT" --levels "$LEVELS" --compile --slots 512 \
                --first-chunk-frames 1 --stateful-code2wav ${KERNEL_FLAGS:-} --out "$OUT/pipeline_stateful.json" 2>&1 \
                | tee "$OUT/pipeline_stateful.log" | grep -vE "^\[talker\] captured" | tail -8 ;;
    pipeline_stateless) checkpoint
              python3 -m bench.pipeline --checkpoint "$CKPT" --levels "$LEVELS" --compile --slots 512 \
                --first-chunk-frames 1 --out "$OUT/pipeline_stateless.json" 2>&1 \
                | tee "$OUT/pipeline_stateless.log" | grep -vE "^\[talker\] captured" | tail -6 ;;
  esac
  echo "$step done +$(( $(date +%s) - t0 ))s"
done
