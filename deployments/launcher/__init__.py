"""Commands run on a host outside Serve: `serve.py` is `qwen3-tts-serve`, `serve run` with the fastest measured
cluster-wide settings (docs/serving.md, "The fastest recipe")."""
