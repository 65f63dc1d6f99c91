"""Runs in the Triton venv (tests/triton_interpreter.py), compiled, not interpreted: every variant of the project's
decode-path Triton kernels that the engine launches, compiled for sm_90 (the H100) by Triton's own compiler and
ptxas, which need no GPU. Prints each variant's registers and spill bytes (`ptxas -v`) and its vector loads as
JSON.

Catches what the interpreter cannot: a kernel that does not compile (types, layouts, unsupported ops) and one
whose tile does not fit in registers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stages import gemv_kernels, invariant_matmul, invariant_matmul_variants, sampling_kernel, window_product
from stages.talker import paged_attention

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_kernel(fn, signature: dict, constexprs: dict, num_warps: int, aligned: tuple[str, ...] = (),
                   count: str | tuple[str, ...] = r"ld\.global(?:\.\w+)*\.v[248]", num_stages: int = 3
                   ) -> tuple[int, ...]:
    """(registers, spill store bytes, matches of `count`) of one variant (one count per regex when `count` is a
    tuple). Pointers, and the integer arguments in `aligned`, are marked divisible by 16 as Triton's launcher marks
    them for the engine's tensors (which is what lets it vectorize loads); the last count is by default the loads
    of 8+ bytes in the PTX."""
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, kind in signature.items() if kind.startswith("*") or name in aligned}
    options = {"num_warps": num_warps, "num_stages": num_stages,
               **({"launch_pdl": True} if constexprs.get("PDL") else {})}
    kernel = triton.compile(ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constexprs, "constexpr")},
                                      constexprs=constexprs, attrs=attrs), target=TARGET, options=options)
    counts = [len(re.findall(pattern, kernel.asm["ptx"])) for pattern in ((count,) if isinstance(count, str) else count)]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        report = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", "-o", "/dev/null", f.name],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return (int(re.search(r"Used (\d+) registers", report).group(1)), int(spills.group(1)) if spills else 0,
            *counts)


def gemv() -> dict:
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "norm_ptr": "*bf16", "res_ptr": "*bf16",
           "bias_ptr": "*bf16", "eps": "fp32", "M": "i32", "N": "i32", "up_offset": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_om": "i32", "stride_rm": "i32"}
    # (N, K, flags) of every product: 1.7B talker (2048 / 6144) and both code predictors and the 0.6B talker (1024 /
    # 3072); q/k/v is 4096 rows in all of them
    products = [(4096, 2048, "norm"), (2048, 2048, "residual"), (6144, 2048, "norm,swiglu"), (2048, 6144, "residual"),
                (4096, 1024, "norm"), (1024, 2048, "residual"), (3072, 1024, "norm,swiglu"), (1024, 3072, "residual"),
                (2048, 1024, "norm,fp32"), (1024, 2048, "bias")]  # the code predictor's final norm + head (fp32
    # logits) and its input projection (1.7B: talker width 2048 -> 1024)
    out = {}
    for n, k, flags in products:
        swiglu = "swiglu" in flags
        for m, pdl in ((1, False), (2, False), (4, False), (8, False), (1, True)):  # PDL: the batch-1 launch mode
            block_n, block_k, warps = gemv_kernels.tiling(m, n, k, swiglu)
            out[f"{n}x{k} {flags} rows{m}{' pdl' if pdl else ''}"] = compile_kernel(gemv_kernels._gemv_kernel, {
                **sig, "out_ptr": "*fp32" if "fp32" in flags else "*bf16"}, {
                "K": k, "M_P": triton.next_power_of_2(m), "BLOCK_N": block_n, "BLOCK_K": block_k,
                "NORM": "norm" in flags, "SWIGLU": swiglu, "RESIDUAL": "residual" in flags, "PDL": pdl,
                "BIAS": "bias" in flags}, warps,
                aligned=("N", "up_offset", "stride_xm", "stride_wn", "stride_om", "stride_rm"))
    return out


def attention() -> dict:
    sig = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "out_ptr")}
    sig |= {"table_ptr": "*i64", "lens_ptr": "*i64", "kn_ptr": "*bf16", "vn_ptr": "*bf16", "sm_scale": "fp32",
            "qw_ptr": "*bf16", "kw_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "eps": "fp32",
            "part_ptr": "*fp32", "ml_ptr": "*fp32"}
    sig |= dict.fromkeys(("stride_qb", "stride_qh", "stride_kblock", "stride_kt", "stride_kh", "stride_tb", "stride_len",
                          "stride_ob", "stride_oh", "stride_knb", "stride_knh", "stride_vnb", "stride_vnh", "stride_cb"),
                         "i32")
    out = {}
    # the paged tilings (batch >= 128, >= 64, below) and the contiguous cache's (16 positions), with and without
    # the new-K/V store and the head prologue
    for block, warps, page in ((16, 1, 16), (16, 2, 16), (32, 4, 16), (16, 4, 16)):
        for write, heads in ((False, False), (True, False), (True, True)):
            out[f"block{block} warps{warps} page{page} write{write} heads{heads}"] = compile_kernel(
                paged_attention._paged_decode_kernel, sig,
                {"GROUP": 2, "GROUP_P": 2, "D": 128, "BLOCK": block, "PAGE": page, "WRITE": write, "HEADS": heads,
                 "SPLITS": 1},
                warps, aligned=tuple(n for n in sig if n.startswith("stride_") and n not in ("stride_tb", "stride_len")))
    # keys split over several programs (attention_splits: batch 1 and 8 of decode_splits), and their merge; PDL:
    # the step's launch mode with `pdl` (batch 1: 16 splits; the code predictor's contiguous cache: no splits)
    for splits, pdl in ((2, False), (16, False), (16, True), (1, True)):
        name = f"splits{splits}{' pdl' if pdl else ''}"
        out[f"block32 warps4 page16 write heads {name}"] = compile_kernel(
            paged_attention._paged_decode_kernel, sig,
            {"GROUP": 2, "GROUP_P": 2, "D": 128, "BLOCK": 32, "PAGE": 16, "WRITE": True, "HEADS": True,
             "SPLITS": splits, "PDL": pdl},
            4, aligned=tuple(n for n in sig if n.startswith("stride_") and n not in ("stride_tb", "stride_len")))
        if splits > 1:
            out[f"combine {name}"] = compile_kernel(
                paged_attention._combine_splits_kernel,
                {"part_ptr": "*fp32", "ml_ptr": "*fp32", "out_ptr": "*bf16", "stride_ob": "i32", "stride_oh": "i32"},
                {"SPLITS": splits, "D": 128, "PDL": pdl}, 1, aligned=("stride_ob", "stride_oh"))
    return out


def sampling() -> dict:
    sig = {"logits_ptr": "*fp32", "out_ptr": "*i64", "do_sample_ptr": "*i1", "temperature_ptr": "*fp32",
           "top_k_ptr": "*i64", "top_p_ptr": "*fp32", "seeds_ptr": "*i64", "counters_ptr": "*i64",
           "counter_offset": "i32", "stride_row": "i32", "V": "i32"}
    return {f"vocab{v_p}{' pdl' if pdl else ''}": compile_kernel(
        sampling_kernel._select_kernel, sig, {"V_P": v_p, "PDL": pdl}, 8 if v_p >= 4096 else 4,
        aligned=("stride_row", "V")) for v_p in (2048, 4096) for pdl in (False, True)}


# (N, K) of the products: the 1.7B model's (talker, code predictor, text projection, heads: `SWEPT`'s shapes) and
# the 0.6B's others (tests/stages/test_triton_compile.py counts the configurations tiles() picks over these)
MATMUL_SHAPES = (*invariant_matmul.SWEPT, (3072, 1024), (1024, 1024))


def plain_matmul(cfg, name: str, layout: str, bias: bool) -> tuple[int, ...]:
    """The invariant GEMM's own kernel (`_matmul_kernel`) in configuration `cfg`, dtype `name`, B as nn.Linear's
    weight.t() or contiguous: (registers, spill bytes, wgmma instructions)."""
    sig = {"a_ptr": f"*{name}", "b_ptr": f"*{name}", "c_ptr": f"*{name}", "bias_ptr": f"*{name}",
           "M": "i32", "N": "i32", "K": "i32", "stride_ab": "i32", "stride_am": "i32",
           "stride_bb": "i32", "stride_cb": "i32", "stride_cm": "i32", "stride_biasm": "i32"}
    ones = {"stride_ak": 1, "stride_cn": 1, "stride_biasn": 1}  # the launcher specializes 1s
    ones |= {"stride_bk": 1} if layout == "weight.t()" else {"stride_bn": 1}
    sig |= {"stride_bn": "i32"} if layout == "weight.t()" else {"stride_bk": "i32"}
    return compile_kernel(invariant_matmul._matmul_kernel, sig, {
        **ones, "BIAS": bias, "IEEE": name == "fp32", "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}, cfg.num_warps,
        aligned=("N", "K", "stride_am", "stride_bn", "stride_bk", "stride_cm", "stride_ab", "stride_bb", "stride_cb",
                 "stride_biasm"),
        count=r"wgmma\.mma_async", num_stages=cfg.num_stages)


def matmul() -> dict:
    """Every plain tile configuration `invariant_matmul.tiles` returns for the 1.7B and 0.6B products (`MATMUL_SHAPES`)
    at every row bucket, per dtype (its Hopper variants: `matmul_variants`), as nn.Linear launches it (B =
    weight.t(), with a bias) and with a contiguous B (bmm, mm of activations). The count is wgmma instructions
    (bf16/fp16: the tensor cores)."""
    types = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    out = {}
    for dtype, name in types.items():
        picked = {invariant_matmul.tiles(m, n, k, dtype) for n, k in MATMUL_SHAPES for m in (1, 100, 200, 4000)}
        for cfg in sorted((c for c in picked if not (c.tma or c.persistent or c.split_k > 1)), key=repr):
            for layout, bias in (("weight.t()", True), ("contiguous", False)):
                out[f"{name} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {layout}"] = \
                    plain_matmul(cfg, name, layout, bias)
    return out


def matmul_variants() -> dict:
    """Every Hopper-variant configuration `invariant_matmul.tiles` returns (the `SWEPT` entries with TMA loads, a
    persistent grid or split-K), bf16, as nn.Linear launches it (B = weight.t(): K-major TMA descriptors; with a
    bias, which split-K leaves to its sum); a TMA + persistent form also with a contiguous B (N-major descriptors)
    and a bias, and in fp32; the split-K sum per split count of the table (and 2, which the sweep tries), with and
    without bias. Counts: wgmma and TMA (cp.async.bulk.tensor) instructions (the variant kernel), 16-byte loads
    (the sum)."""
    table = [cfg for per_bucket in invariant_matmul.SWEPT.values() for cfg in per_bucket]
    aligned = ("N", "K", "K_CHUNK", "stride_am", "stride_bn", "stride_bk", "stride_cm", "stride_ab", "stride_bb",
               "stride_cb", "stride_cs", "stride_biasm")
    out = {}

    def variant(cfg, name: str, layout: str, bias: bool) -> None:
        sig = {"a_ptr": f"*{name}", "b_ptr": f"*{name}", "c_ptr": "*fp32" if cfg.split_k > 1 else f"*{name}",
               "bias_ptr": f"*{name}", "M": "i32", "N": "i32", "K": "i32", "K_CHUNK": "i32", "stride_ab": "i32",
               "stride_am": "i32", "stride_bb": "i32", "stride_cs": "i32", "stride_cb": "i32", "stride_cm": "i32",
               "stride_biasm": "i32"}
        ones = {"stride_ak": 1, "stride_cn": 1, "stride_biasn": 1}
        ones |= {"stride_bk": 1} if layout == "weight.t()" else {"stride_bn": 1}
        sig |= {"stride_bn": "i32"} if layout == "weight.t()" else {"stride_bk": "i32"}
        flags = " tma" * cfg.tma + " persistent" * cfg.persistent + f" split{cfg.split_k}" * (cfg.split_k > 1)
        key = (f"{name} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{flags} {layout}"
               f"{' bias' if bias else ''}")
        out[key] = compile_kernel(invariant_matmul_variants._variant_kernel, sig, {
            **ones, "BIAS": bias and cfg.split_k == 1, "IEEE": name == "fp32", "BLOCK_M": cfg.block_m,
            "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m, "TMA": cfg.tma,
            "B_KMAJOR": layout == "weight.t()", "PERSISTENT": cfg.persistent, "NUM_SMS": 132, "SPLIT": cfg.split_k},
            cfg.num_warps, aligned=aligned, count=(r"wgmma\.mma_async", r"cp\.async\.bulk\.tensor"),
            num_stages=cfg.num_stages)

    # the table's plain configurations run the default kernel, whose configurations `matmul` checks
    for cfg in sorted({cfg for cfg in table if cfg.tma or cfg.persistent or cfg.split_k > 1}, key=repr):
        variant(cfg, "bf16", "weight.t()", True)
    both = invariant_matmul.Tiles(128, 64, 64, 8, 8, 4, tma=True, persistent=True)
    variant(both, "bf16", "contiguous", True)
    variant(invariant_matmul.Tiles(64, 32, 32, 8, 4, 3, tma=True, persistent=True), "fp32", "weight.t()", True)
    for split in sorted({cfg.split_k for cfg in table if cfg.split_k > 1} | {2}):
        for bias in (False, True):
            out[f"sum split{split}{' bias' if bias else ''}"] = compile_kernel(
                invariant_matmul_variants._sum_splits_kernel,
                {"part_ptr": "*fp32", "c_ptr": "*bf16", "bias_ptr": "*bf16", "M": "i32", "N": "i32",
                 "stride_ps": "i32", "stride_pb": "i32", "stride_pm": "i32", "stride_cb": "i32", "stride_cm": "i32",
                 "stride_biasm": "i32"},
                {"stride_cn": 1, "stride_biasn": 1, "SPLIT": split, "BIAS": bias,
                 "BLOCK_M": invariant_matmul_variants.SUM_BLOCK_M, "BLOCK_N": invariant_matmul_variants.SUM_BLOCK_N},
                4, aligned=("N", "stride_ps", "stride_pb", "stride_pm", "stride_cb", "stride_cm", "stride_biasm"),
                count=r"ld\.global(?:\.\w+)*\.v4")
    return out


def window_products() -> dict:
    """The window kernel (stages/window_product.py) at the tiles `window_product.tiles` gives the released
    decoder's convolutions (input channels 96 x 2^n and 1024, output columns 1 to 1536; the transposed ones' s x O),
    bf16, channels-last input (the fused vocoder's) and channel-first: (registers, spills, wgmma instructions)."""
    problems = {(c, n) for c in (96, 192, 384, 768, 1536, 1024) for n in (1, 96, 192, 384, 768, 1536)}
    problems |= {(1536, 8 * 768), (768, 5 * 384), (384, 4 * 192), (192, 3 * 96), (1024, 2 * 1024)}
    out = {}
    sig = {name: "i32" for name in ("M", "N", "C", "TAPS", "T_OUT", "L", "INNER", "OUT_CH", "sx_b", "sx_c", "sx_i",
                                     "sx_l", "sw_j", "sw_c", "sw_n", "so_b", "so_i", "so_t", "so_r", "so_o",
                                     "STEP", "DIL", "PAD")}
    sig |= {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "bias_ptr": "*bf16"}
    for cfg in sorted({window_product.tiles(c, n) for c, n in problems}, key=repr):
        for layout in ("channels-last", "channel-first"):
            ones = {"sx_c": 1, "so_o": 1} if layout == "channels-last" else {"sx_l": 1, "so_t": 1}
            key = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {layout}"
            out[key] = compile_kernel(window_product._window_product_kernel,
                                      {k: v for k, v in sig.items() if k not in ones}, {
                **ones, "BIAS": True, "IEEE": False, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
                "BLOCK_K": cfg.block_k, "GROUP_M": 8}, cfg.num_warps, count=r"wgmma\.mma_async",
                num_stages=cfg.num_stages)
    return out


if __name__ == "__main__":
    groups = sys.argv[1:] or ["gemv", "attention", "sampling", "matmul", "matmul_variants", "window_products"]
    print(json.dumps({group: globals()[group]() for group in groups}))
