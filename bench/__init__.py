"""The maintained benchmark harness.

- `loadgen/`: the HTTP load generator (`python -m bench.loadgen`), with continuity metrics;
- `pipeline.py`: both engines in one process (the served share's baseline); `talker.py`, `code2wav.py`: each engine
  alone; `code2wav_fidelity.py`: chunked against whole-utterance decoding; `startup.py`: ready time by phase;
  `parity_gpu.py`: full-size parity with the official package;
- `live.py`: the WebSocket live-text client; `replica_stats.py`: the engines' counters inside a running app;
- `kernels/`: kernel tiling sweeps; `kernel_flags.py`: the talker's kernel switches as flags;
- `gpu_serve_runbook.sh` (served runs) and `gpu_engines.sh` (engine runs): the two GPU runbooks.
"""
