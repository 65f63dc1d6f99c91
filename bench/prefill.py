"""Admission (batched prefill + first codebook-0 token) cost by prompt shape and attention backend.

Serving brings prompts of ever new (batch, width) shapes. For each attention-backend choice this times
prefills of shapes never seen before (first call) and the same shapes again (cached), with prompt widths
unpadded so that every width is new. It explains the ~100 ms admissions of the first H100 serving run.

    python bench/prefill.py --checkpoint CKPT          # GPU
    python bench/prefill.py --tiny                     # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages.talker.runner as runner_module  # noqa: E402
from stages.contract import SamplingParams  # noqa: E402
from stages.model import Qwen3TTS  # noqa: E402
from stages.prompts import build_prompt  # noqa: E402
from stages.random_checkpoint import write_random_checkpoint  # noqa: E402
from stages.talker.prefill import build_prefill  # noqa: E402
from stages.talker.runner import TalkerRunner  # noqa: E402

CHOICES = {
    "torch default": None,
    "flash/efficient/math (engine)": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--size", default="1.7b", choices=["0.6b", "1.7b"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--workdir", default="/tmp/qwen3-tts-bench")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = Path(args.workdir) / f"{args.size}-custom_voice{'-tiny' if args.tiny else ''}"
        if not (Path(ckpt) / "config.json").exists():
            write_random_checkpoint(ckpt, args.size, "custom_voice", tiny=args.tiny, dtype=dtype, device=device)
    model = Qwen3TTS.load(ckpt, device=device, dtype=dtype, decoder=False, voice=False, log=print)
    runner_module._PREFILL_WIDTH_MULTIPLE = 1  # every width below is a new shape
    runner = TalkerRunner(model, 16, 1024, 256, (128, 256, 512, 1024))
    speaker = sorted(model.config.talker.speakers)[0]
    sampling = SamplingParams()

    def admit(n: int, words: int) -> float:
        prompt = build_prompt(model.config, model.tokenizer, " ".join(["word"] * words), speaker=speaker)
        embeds = build_prefill(runner.talker, model.config, prompt)
        t0 = time.perf_counter()
        runner.prefill(0, [embeds] * n, [sampling] * n, list(range(n)))
        runner.first_tokens(0, n)
        return (time.perf_counter() - t0) * 1e3

    admit(1, 3)  # load kernels once
    offset = 0
    print("| attention backends | shapes | first call ms (median / max) | same shape again ms (median) |")
    print("|---|---:|---:|---:|")
    for label, backends in CHOICES.items():
        runner.prefill_sdpa_backends = backends
        shapes = [(n, 4 + offset + 3 * i) for i, n in enumerate((1, 1, 2, 4, 8, 16, 1, 3))]
        offset += 1  # widths not seen by the previous choice
        first = [admit(n, w) for n, w in shapes]
        again = [admit(n, w) for n, w in shapes]
        print(f"| {label} | {len(shapes)} | {statistics.median(first):.1f} / {max(first):.1f} | "
              f"{statistics.median(again):.1f} |", flush=True)


if __name__ == "__main__":
    main()
