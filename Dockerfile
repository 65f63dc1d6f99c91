# The GPU serving image: CUDA runtime + this project, torch and Ray pinned by constraints.txt (what CI tests).
#   docker build -t qwen3-tts-serve .
#   docker run --gpus all -p 8000:8000 -e QWEN3_TTS_MODEL=Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice \
#     -v ~/.cache/huggingface:/root/.cache/huggingface qwen3-tts-serve
# The command is `qwen3-tts-serve configs/high_concurrency.yaml`: `serve run` with the cluster-wide settings measured
# fastest (throughput-optimized Serve, HAProxy ingress, CUDA MPS; docs/serving.md). MPS's control binary comes
# from the host's driver through the NVIDIA container toolkit (the `utility` capability); without it the launcher
# serves without MPS. The KubeRay image (Ray's own base, for a Ray cluster) is cluster/kuberay/Dockerfile.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv libsndfile1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv

WORKDIR /opt/qwen3-tts-serve
COPY constraints.txt pyproject.toml ./
# torch first, from PyTorch's CUDA 12.8 index, at the constrained version (a layer that survives code changes)
RUN pip install -c constraints.txt --index-url https://download.pytorch.org/whl/cu128 torch
COPY stages ./stages
COPY deployments ./deployments
COPY configs ./configs
RUN pip install -c constraints.txt . && python -c "import deployments.builder"

EXPOSE 8000 8080 8265
CMD ["qwen3-tts-serve", "configs/high_concurrency.yaml"]
