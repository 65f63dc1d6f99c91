"""Runs under Triton's interpreter (tests/triton_interpreter.py): one codec frame's code-predictor loop
(`predict_frame_codes`: 15 passes of the code predictor, each with its sampling) with every opt-in kernel path
(the GEMVs with the final norm + head fused, q/k head norm + RoPE in the attention kernel, the sampling kernel)
against the eager path, greedy and seeded sampling, fp32, on a tiny random talker (a 256-id code predictor).
Prints the comparison as JSON."""

from __future__ import annotations

import collections
import json

import interpreter_fixes  # noqa: F401  (first: before any kernel runs)
import torch

from stages import gemv_kernels, sampling_kernel
from stages.config import ModelConfig
from stages.contract import NUM_CODEBOOKS, SamplingParams
from stages.layers import LayerKernels, attention_inputs, attention_output_and_mlp
from stages.random_checkpoint import main_config
from stages.sampling import SamplingRows, select_tokens
from stages.talker import contiguous_kv
from stages.talker.frame import new_code_predictor_cache, predict_frame_codes
from stages.talker.model import Talker
from stages.talker.paged_attention import HeadNorm


def main() -> dict:
    contiguous_kv.kernel_available = lambda _device: True  # the code predictor's decode kernel on CPU (interpreted)
    calls = []  # which kernels ran: every GEMV and every attention call that applied a HeadNorm
    gemv, head_norm_args = gemv_kernels.gemv, HeadNorm.args
    gemv_kernels.gemv = lambda *a, **kw: calls.append("gemv") or gemv(*a, **kw)
    HeadNorm.args = lambda self: calls.append("head_norm") or head_norm_args(self)
    torch.manual_seed(0)
    config = main_config("1.7b", "custom_voice", tiny=True)
    # a 256-id code predictor head (2048 in the releases): the interpreter runs its GEMV one program per 4 ids, 15
    # times a frame (with 2048 ids, ~85% of this script's ~2.5 min)
    config["talker_config"]["code_predictor_config"]["vocab_size"] = 256
    talker = Talker(ModelConfig.from_dict(config).talker).eval()
    with torch.no_grad():
        for p in talker.parameters():
            p.normal_(0.0, 0.5)
    cp_stack = talker.code_predictor.model
    result = {"projection": type(talker.code_predictor.small_to_mtp_projection).__name__}
    # one frame of two rows, one greedy and one sampled (the interpreter runs ~200 kernel launches per frame, slowly)
    b = 2
    hidden = torch.randn(b, talker.config.hidden_size)
    c0 = torch.randint(0, 2048, (b,))
    seeds, frame_index = torch.arange(b) * 7 + 11, torch.full((b,), 5)
    sub = SamplingRows.from_params([SamplingParams(do_sample=False, subtalker_do_sample=False),
                                    SamplingParams(subtalker_top_k=20, subtalker_top_p=0.9)], torch.device("cpu")).sub
    codes, logits, kernel_calls = {}, {}, {}
    for name in ("eager", "fused"):
        fused = name == "fused"
        cp_stack.kernels = talker.code_predictor.projected_embeddings = None
        if fused:
            cp_stack.use_kernels(LayerKernels(pre=attention_inputs, post=attention_output_and_mlp,
                                              gemv_rows=8, heads_in_attention=True), NUM_CODEBOOKS)
            talker.code_predictor.project_codec_embeddings()  # as the runner does with gemv_rows
        cache = new_code_predictor_cache(talker, b)
        cache.decode_kernel = fused
        calls.clear()
        seen = []
        head = talker.code_predictor.forward_step
        talker.code_predictor.forward_step = lambda *a, head=head, seen=seen: seen.append(out := head(*a)) or out
        with torch.no_grad():
            codes[name] = predict_frame_codes(talker, hidden, c0, cache, sub, seeds, frame_index,
                                              sampling_kernel.select_tokens if fused else select_tokens)
        del talker.code_predictor.forward_step
        logits[name] = seen
        kernel_calls[name] = dict(collections.Counter(calls))
    result["batch2_mixed"] = {
        "codes_equal": bool(torch.equal(codes["eager"], codes["fused"])),
        "kernel_calls": kernel_calls["fused"],
        "eager_kernel_calls": kernel_calls["eager"],
        "max_logit_diff": max((f.float() - e.float()).abs().max().item()
                              for e, f in zip(logits["eager"], logits["fused"], strict=True)),
        "distinct_codes": len(set(codes["fused"].flatten().tolist())),
    }
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
