"""Row-invariant products on CUDA for deterministic mode: cuBLAS without a workspace, checked at start.

With a workspace, cuBLAS may split a product's K dimension across programs and add the parts in a second pass when
rows are few, so a row's rounding depends on how many rows share the product (on the H200 the code predictor's
down projection did so at up to 128 rows). Without one (`CUBLAS_WORKSPACE_CONFIG=:0:0`, which also caps cuBLASLt's
while torch shares one workspace between them, its default; `use_no_workspace` sets cuBLASLt's to 0 too where torch
can) that reduction is gone, and on the H200 every product of the 1.7B model gave each row the same bits at every
row count from 1 to 2,048, with no measurable cost (docs/benchmarks.md). That is what this cuBLAS does, not a
promise of its documentation, so a deterministic engine checks its own products on its own device before it serves
(`check`) and refuses to start where a row's bits move.

Where torch sets the size at run time (`torch.backends.cuda.cublas_workspace_size`), `use_no_workspace` takes
effect for the workspaces made after it; older torch reads `CUBLAS_WORKSPACE_CONFIG` once, at the process's first
product, so there it must run before that: a Serve replica calls it before loading a deterministic model
(deployments/loading.py), the Talker engine when it is constructed, and `check` tells if it came too late.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from stages.layers import DecoderLayer

WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"
# row counts checked besides the engine's own (decode buckets, the code predictor's first pass at twice them, prefill
# graphs): odd rows, partial and whole tiles, eager prefills; not 1, which a deterministic engine never runs (cuBLAS
# may take another kernel there) unless the engine asks for it
CHECK_ROWS = (2, 3, 5, 7, 12, 31, 64, 100, 127, 200, 333, 640, 1000, 2048, 4096)


class ProductsNotRowInvariant(RuntimeError):
    """Deterministic mode cannot run on this device: a product's rows depend on the row count."""


def use_no_workspace() -> None:
    """cuBLAS without a workspace from here on in this process (no split-K reduction pass)."""
    os.environ[WORKSPACE_ENV] = NO_WORKSPACE
    if torch.cuda.is_available():
        # where torch sets the sizes at run time, they take precedence over the environment for workspaces made
        # from here on
        for name in ("cublas_workspace_size", "cublaslt_workspace_size"):
            set_size = getattr(torch.backends.cuda, name, None)
            if set_size is not None:
                set_size(0)


def product_shapes(module: nn.Module) -> set[tuple[int, int, bool]]:
    """(N, K, bias) of the products `module` runs: every nn.Linear, and the row-stacked products of the decoder
    layers (`DecoderLayer.fuse_projections`: q/k/v and gate/up, whether fused yet or not)."""
    shapes = set()
    for m in module.modules():
        if isinstance(m, nn.Linear):
            shapes.add((m.out_features, m.in_features, m.bias is not None))
        if isinstance(m, DecoderLayer):
            a, mlp = m.self_attn, m.mlp
            shapes.add((sum(p.out_features for p in (a.q_proj, a.k_proj, a.v_proj)), a.q_proj.in_features, False))
            shapes.add((mlp.gate_proj.out_features + mlp.up_proj.out_features, mlp.gate_proj.in_features, False))
    return shapes


@torch.no_grad()
def differing_rows(n: int, k: int, bias: bool, rows: Iterable[int], device: torch.device, dtype: torch.dtype,
                   seed: int = 0) -> list[int]:
    """The row counts among `rows` at which a row of an [m, k] x [k, n] product (random operands) is not
    bit-identical to the same row of the product over the most rows (each m at the start, middle and end)."""
    rows = sorted(set(rows))
    top = rows[-1]
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) / k ** 0.5
    b = torch.randn(n, device=device, dtype=dtype, generator=gen) if bias else None
    x = torch.randn(top, k, device=device, dtype=dtype, generator=gen)
    full = F.linear(x, w, b)
    return [m for m in rows
            if not all(torch.equal(F.linear(x[s:s + m], w, b), full[s:s + m]) for s in {0, (top - m) // 2, top - m})]


def check(module: nn.Module, rows: Iterable[int], device: torch.device, dtype: torch.dtype) -> None:
    """Raise `ProductsNotRowInvariant` unless every product of `module` gives a row the same bits at each of `rows`
    (and `CHECK_ROWS`) as at the most of them."""
    rows = set(rows) | set(CHECK_ROWS)
    bad = {shape: m for shape in sorted(product_shapes(module))
           if (m := differing_rows(*shape, rows, device, dtype))}
    if bad:
        found = "; ".join(f"{n} x {k} at {m[:6]} rows" for (n, k, _), m in bad.items())
        raise ProductsNotRowInvariant(
            f"deterministic mode: cuBLAS on {torch.cuda.get_device_name(device)} gives a row different bits at "
            f"different row counts ({found}; {WORKSPACE_ENV}={os.environ.get(WORKSPACE_ENV)!r}: set it to "
            f"{NO_WORKSPACE!r} before the process's first product), so a seeded request's output would depend on "
            "its batch: run without `deterministic` on this device")
