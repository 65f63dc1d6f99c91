"""Kernel tiling sweeps for retuning on a new GPU (CUDA only): `python -m bench.kernels.gemv`, `.paged_attention`,
`.select`."""
