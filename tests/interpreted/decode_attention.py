"""Runs under Triton's interpreter (tests/triton_interpreter.py): the decode attention kernel on tensor cores
(`DecodeTiling(tensor_cores=True)`, stages/talker/paged_attention.py) against the CUDA-core kernel and against
float64 softmax attention, over rows of several key tiles (a partial last tile, keys on shuffled pages), with and
without split keys, with the new key stored and q/k's head norm and RoPE applied in the kernel; and both kernels
on the code predictor's contiguous cache. fp32 (IEEE products). Prints the max errors as JSON."""

from __future__ import annotations

import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch

from stages.layers import Rotary
from stages.talker.paged_attention import (
    DecodeTiling,
    HeadNorm,
    _kernel_choice,
    contiguous_decode_attention,
    paged_decode_attention,
)

D, EPS, PAGE = 16, 1e-6, 4
TENSOR_CORES = DecodeTiling(16, 4, tensor_cores=True)
CUDA_CORES = DecodeTiling(16, 4)


def exact(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
          page: int = PAGE) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(D)) v over each row's keys, read through its block table."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_pool.shape[1]
    for row, n in enumerate(lens.tolist()):
        idx = torch.arange(n)
        tokens = table[row, idx // page] * page + idx % page
        k = k_pool[tokens].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, n, D]
        v = v_pool[tokens].double().repeat_interleave(group, 1).transpose(0, 1)
        w = torch.softmax(q[row].double()[:, None] @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1)  # [H, 1, n]
        out[row] = (w @ v)[:, 0]
    return out


def case(heads: int, n_kv: int, lens: list[int], gen: torch.Generator) -> dict:
    b = len(lens)
    per = -(-max(lens) // PAGE)
    blocks = b * per + 1
    pool = torch.randn(blocks * PAGE, n_kv, D, generator=gen)
    table = torch.randperm(blocks, generator=gen)[:b * per].view(b, per)
    lens_t = torch.tensor(lens)
    q = torch.randn(b, heads, D, generator=gen)
    result = {}
    reference = exact(q, pool, pool * 0.5, table, lens_t)
    for splits in (1, 2, 4):
        for name, tiling in (("tensor_cores", TENSOR_CORES), ("cuda_cores", CUDA_CORES)):
            got = paged_decode_attention(q, pool, pool * 0.5, table, lens_t, PAGE, tiling=tiling, splits=splits)
            result[f"{name}_splits{splits}"] = (got.double() - reference).abs().max().item()
    # the decode step's call: the new key/value stored at the last position, q/k projected (head norm + RoPE here)
    rotary = Rotary(D, 10000.0)
    cos, sin = rotary(lens_t[:, None] - 1, torch.float32)
    qn_w, kn_w = torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5
    new_kv = (torch.randn(b, n_kv, D, generator=gen), torch.randn(b, n_kv, D, generator=gen))
    outs, stored = {}, {}
    for name, tiling, splits in (("tensor_cores", TENSOR_CORES, 1), ("tensor_cores_split4", TENSOR_CORES, 4),
                                 ("cuda_cores", CUDA_CORES, 1)):
        k_pool, v_pool = pool.clone(), pool.clone()
        outs[name] = paged_decode_attention(q, k_pool, v_pool, table, lens_t, PAGE, tiling=tiling, new_kv=new_kv,
                                            head_norm=HeadNorm(qn_w, kn_w, EPS, cos, sin), splits=splits)
        stored[name] = (k_pool, v_pool)
    for name in ("tensor_cores", "tensor_cores_split4"):
        result[f"{name}_step_vs_cuda_cores"] = (outs[name] - outs["cuda_cores"]).abs().max().item()
        result[f"{name}_step_stored"] = max((a - c).abs().max().item()
                                            for a, c in zip(stored[name], stored["cuda_cores"], strict=True))
    return result


def contiguous(gen: torch.Generator, D: int = D) -> dict:
    """The code predictor's contiguous cache ([B, n_kv, 16, D], every row at the same length): both kernels against
    float64 attention, storing the new key/value at the last position. Heads narrower than 16 (the tiny code
    predictor's 8) run on CUDA cores whichever kernel the tiling asks for."""
    b, heads, n_kv, length = 3, 4, 2, 16
    rows = torch.arange(b)[:, None]
    q = torch.randn(b, heads, D, generator=gen)
    new_kv = (torch.randn(b, n_kv, D, generator=gen), torch.randn(b, n_kv, D, generator=gen))
    base = torch.randn(b, n_kv, length, D, generator=gen)
    result = {}
    for n in (1, 9, 16):
        for name, tensor_cores in (("cuda_cores", False), ("tensor_cores", True)):
            k, v = base.clone(), base.clone() * 0.5
            got = contiguous_decode_attention(q, k, v, rows, torch.tensor([n]),
                                              DecodeTiling(16, 2, tensor_cores=tensor_cores), new_kv=new_kv)
            pool_k, pool_v = (t.transpose(1, 2).reshape(b * length, n_kv, D) for t in (k, v))
            # each row one page of `length` positions
            expected = exact(q, pool_k, pool_v, torch.arange(b)[:, None], torch.full((b,), n), page=length)
            result[f"{name}_keys{n}"] = (got.double() - expected).abs().max().item()
            result[f"{name}_keys{n}_stored"] = (k[:, :, n - 1] - new_kv[0]).abs().max().item()
    return result


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    result = {"gqa2": case(4, 2, [37, 20, 5, 16], gen),  # 3 tiles with a partial one; one tile; exactly one tile
              "gqa1": case(2, 2, [33, 1], gen),  # a group of one query head; a row of one key
              "contiguous": contiguous(gen), "contiguous_head_dim8": contiguous(gen, 8),
              "tensor_cores_by_head_dim": {str(d): _kernel_choice(TENSOR_CORES, 2, torch.bfloat16, d).get(
                  "TENSOR_CORES", False) for d in (8, 16, 128)}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
