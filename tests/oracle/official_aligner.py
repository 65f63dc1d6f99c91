"""Runs the official Qwen3-ForcedAligner (qwen-asr 0.0.6) inside the aligner oracle venv (never in the main env).

    python official_aligner.py align SPEC.json OUT_DIR
        SPEC: {"checkpoint": DIR, "block_attention": bool, "batches": [{"name", "audios": [WAV16K.npy, ...],
               "texts": [...], "languages": [...]}]}
        OUT_DIR/<name>.pt: {"words": [[(text, start, end), ...], ...], "logits": [B, S, C] float32,
                            "input_ids": [B, S], "attention_mask": [B, S]}
    python official_aligner.py write CONFIG.json OUT_DIR SEED
        a random-weight model built by the official classes from CONFIG, saved with the official save_pretrained
        (weights only: the tokenizer and preprocessor files are copied next to CONFIG by the caller)
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from qwen_asr import Qwen3ForcedAligner
from qwen_asr.core.transformers_backend import Qwen3ASRConfig, Qwen3ASRForConditionalGeneration
from qwen_asr.core.transformers_backend.modeling_qwen3_asr import Qwen3ASRAudioEncoderLayer


def use_block_attention() -> None:
    """The audio tower's attention blocked by `cu_seqlens`, as the official flash-attention and vLLM paths compute it.

    The official eager/SDPA path (the default, and the only one on a CPU) builds `cu_seqlens` but passes no mask, so
    there every audio token attends to the whole waveform; its own unused `_prepare_attention_mask` is the block mask
    the other paths imply. This applies that mask on the CPU."""
    forward = Qwen3ASRAudioEncoderLayer.forward

    def blocked(self, hidden_states, cu_seqlens, attention_mask=None, **kwargs):
        if attention_mask is None:
            n = hidden_states.shape[0]
            attention_mask = torch.full((1, 1, n, n), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype)
            bounds = cu_seqlens.tolist()
            for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                attention_mask[..., start:end, start:end] = 0
        return forward(self, hidden_states, cu_seqlens, attention_mask=attention_mask, **kwargs)

    Qwen3ASRAudioEncoderLayer.forward = blocked


def align(spec_path: str, out_dir: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("block_attention"):
        use_block_attention()
    aligner = Qwen3ForcedAligner.from_pretrained(spec["checkpoint"], dtype=torch.float32, device_map="cpu")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    captured = {}

    def capture(module, args, inputs, result):  # the official align calls model.thinker(**inputs) once per batch
        captured.update(logits=result.logits.float().clone(), input_ids=inputs["input_ids"].clone(),
                        attention_mask=inputs["attention_mask"].clone())

    aligner.model.thinker.register_forward_hook(capture, with_kwargs=True)
    for batch in spec["batches"]:
        audios = [(np.load(p), 16000) for p in batch["audios"]]
        results = aligner.align(audio=audios, text=batch["texts"], language=batch["languages"])
        words = [[(it.text, it.start_time, it.end_time) for it in r] for r in results]
        torch.save({"words": words, **captured}, out / f"{batch['name']}.pt")


def write(config_path: str, out_dir: str, seed: str) -> None:
    cfg = Qwen3ASRConfig(**json.loads(Path(config_path).read_text()))
    torch.manual_seed(int(seed))
    model = Qwen3ASRForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # the official init leaves biases at zero: give them values, as real checkpoints have
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.02)
            if name == "thinker.lm_head.weight":
                p.copy_(torch.randn_like(p) * 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)


if __name__ == "__main__":
    {"align": align, "write": write}[sys.argv[1]](*sys.argv[2:])
