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

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stages import gemv_kernels, sampling_kernel, window_product
from stages.code2wav import fast, state_carry
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
    # CUDA-core tilings (the contiguous cache's from 64 rows up: 16 keys x 1 warp; the others the sweep's and the
    # narrow-head fallback's), with and without the new-K/V store and the head prologue
    for block, warps, page in ((16, 1, 16), (16, 2, 16), (32, 4, 16), (16, 4, 16)):
        for write, heads in ((False, False), (True, False), (True, True)):
            out[f"block{block} warps{warps} page{page} write{write} heads{heads}"] = compile_kernel(
                paged_attention._paged_decode_kernel, sig,
                {"GROUP": 2, "GROUP_P": 2, "D": 128, "BLOCK": block, "PAGE": page, "WRITE": write, "HEADS": heads,
                 "SPLITS": 1},
                warps, aligned=tuple(n for n in sig if n.startswith("stride_") and n not in ("stride_tb", "stride_len")))
    # the paged cache's kernel on tensor cores at decode_tiling's two tilings (>= 64 rows, below), as the step
    # calls it (new key/value stored, head prologue), and below 64 rows with keys split (batch 1, 8) and PDL; the
    # code predictor's contiguous cache below 64 rows (contiguous_tiling: 16 keys, 4 warps), with and without PDL
    tc_variants = [((64, 2, 3), 1, False), ((32, 4, 2), 1, False), ((32, 4, 2), 16, False), ((32, 4, 2), 2, False),
                   ((32, 4, 2), 16, True), ((32, 4, 2), 1, True), ((16, 4, 2), 1, False), ((16, 4, 2), 1, True)]
    for (block, warps, stages), splits, pdl in tc_variants:
        out[f"tensor cores block{block} warps{warps} stages{stages} splits{splits}{' pdl' if pdl else ''}"] = \
            compile_kernel(paged_attention._paged_decode_kernel, sig,
                           {"GROUP": 2, "GROUP_P": 16, "D": 128, "BLOCK": block, "PAGE": 16, "WRITE": True,
                            "HEADS": True, "SPLITS": splits, "PDL": pdl, "TENSOR_CORES": True}, warps, num_stages=stages,
                           aligned=tuple(n for n in sig if n.startswith("stride_") and n not in ("stride_tb", "stride_len")))
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


def snake() -> dict:
    """The vocoder's two SnakeBeta kernels (stages/code2wav/fast.py) as the engine launches them (bf16, the SFU sine,
    with and without the bias): (registers, spills, SFU sines, local-memory accesses: libdevice's sinf would show)."""
    count = (r"sin\.approx", r"(?:ld|st)\.local")
    ints = {name: "i32" for name in ("C", "T", "T_out", "PAD")}
    snake_sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "alpha_ptr": "*fp32", "inv_beta_ptr": "*fp32", "bias_ptr": "*bf16",
                 "stride_xb": "i32", "stride_xt": "i32", **ints}
    residual_sig = {"x_ptr": "*bf16", "h_ptr": "*bf16", "y_ptr": "*bf16", "s_ptr": "*bf16", "xb_ptr": "*bf16",
                    "hb_ptr": "*bf16", "alpha_ptr": "*fp32", "inv_beta_ptr": "*fp32", "sxb": "i32", "sxt": "i32",
                    "shb": "i32", "sht": "i32", **ints}
    tile = {"BLOCK_T": fast._BLOCK_T, "BLOCK_C": fast._BLOCK_C, "FAST_SIN": True}
    out = {f"snake bias{int(bias)}": compile_kernel(fast._snake_kernel, snake_sig, {"HAS_BIAS": bias, **tile}, 4,
                                                    aligned=("C", "stride_xb", "stride_xt"), count=count)
           for bias in (False, True)}
    out |= {f"residual_snake bias{int(bias)}": compile_kernel(
        fast._residual_snake_kernel, residual_sig, {"HAS_XB": bias, "HAS_HB": bias, **tile}, 4,
        aligned=("C", "sxb", "sxt", "shb", "sht"), count=count) for bias in (False, True)}
    return out


def window_products() -> dict:
    """The window kernel (stages/window_product.py) at the tiles `window_product.tiles` gives the released
    decoder's convolutions (input channels 96 x 2^n and 1024, output columns 1 to 1536; the transposed ones' s x O),
    bf16, channels-last input (the fused vocoder's) and channel-first: (registers, spills, wgmma instructions)."""
    problems = {(c, n) for c in (96, 192, 384, 768, 1536, 1024) for n in (1, 96, 192, 384, 768, 1536)}
    problems |= {(1536, 8 * 768), (768, 5 * 384), (384, 4 * 192), (192, 3 * 96), (1024, 2 * 1024)}
    problems |= set(window_product.SWEPT)
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


def state_carry_kernels() -> dict:
    """The stateful decode's carry kernel (stages/code2wav/state_carry.py) at the released decoder's state widths
    (1, 6, 18 and 54 columns -> blocks of 1, 8, 32 and 64), bf16, a time-major input (channel stride 1), a bool
    flag per row: (registers, spills, barriers: the one between its reads and its writes of the slot)."""
    sig = {"p_ptr": "*bf16", "s_ptr": "*bf16", "slot_ptr": "*i64", "keep_ptr": "*i1", "len_ptr": "*i64",
           **{name: "i32" for name in ("C", "N", "RATE", "spb", "spt", "ssr", "ssc", "sst")}}
    return {f"block_n{n}": compile_kernel(state_carry._carry_kernel, sig, {"spc": 1, "BLOCK_N": n,
                                                                           "BLOCK_C": state_carry.block_c(n)}, 4,
                                          count=r"bar\.sync") for n in (1, 8, 32, 64)}


if __name__ == "__main__":
    groups = sys.argv[1:] or ["gemv", "attention", "sampling", "snake", "state_carry_kernels", "window_products"]
    print(json.dumps({group: globals()[group]() for group in groups}))
