"""Kernel tiling sweeps for retuning on a new GPU (CUDA only): `python -m bench.kernels.gemv`, `.paged_attention`,
`.select`; `gpu_timing` holds the per-call timer and the profiler's kernels grouped by name that GPU
micro-benchmarks share."""
