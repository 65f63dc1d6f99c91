"""The talker's opt-in kernel paths as command-line flags, shared by the benches (bench.talker, bench.pipeline):
the names and defaults of `TalkerEngineConfig` and its `KernelOptions` (docs/talker_engine.md, "Kernels per frame")."""

from __future__ import annotations

import argparse

from stages.talker.engine_config import KernelOptions, TalkerEngineConfig


def add_kernel_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gemv-rows", type=int, default=KernelOptions.gemv_rows,
                    help="with --compile: forwards of <= this many rows run as Triton GEMVs (0: cuBLAS throughout)")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=TalkerEngineConfig.pdl,
                    help="with --compile: the step's Triton kernels use programmatic dependent launch (H100+)")
    ap.add_argument("--heads-in-attention", action=argparse.BooleanOptionalAction,
                    default=KernelOptions.heads_in_attention,
                    help="with --compile: the decode attention kernel applies q/k's head norm and RoPE")
    ap.add_argument("--attention-splits", action=argparse.BooleanOptionalAction,
                    default=KernelOptions.attention_splits,
                    help="decode attention: a few rows' keys split over more programs (flash decoding)")
    ap.add_argument("--sampling-kernel", action=argparse.BooleanOptionalAction,
                    default=KernelOptions.sampling_kernel, help="token selection as one Triton program per row")


def kernel_kwargs(args: argparse.Namespace, **kernels) -> dict:
    """The flags as TalkerEngineConfig keyword arguments (`kernels`: more KernelOptions fields)."""
    return {"pdl": args.pdl, "kernels": KernelOptions(
        gemv_rows=args.gemv_rows, heads_in_attention=args.heads_in_attention, sampling_kernel=args.sampling_kernel,
        attention_splits=args.attention_splits, **kernels)}
