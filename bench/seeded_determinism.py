"""Does a seeded request give the same codes alone and inside batches of 64 and 256 (GPU, bf16, graphs, compile)?

The sampler's randomness is counter-based (same seed -> same uniforms whatever the batch), but the logits it
samples from come from GEMMs whose kernels and reduction order depend on the batch bucket; in bf16 a
different rounding can flip a sampled token, after which the streams diverge. This measures it: the same
seeded request alone (bucket 1) and with 63 and 255 other requests, comparing codes frame by frame.

    python -m bench.seeded_determinism --checkpoint CKPT --frames 75 --out seeded.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import torch

from stages.contract import SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.talker.engine import TalkerEngine, TalkerEngineConfig


async def codes(engine, request) -> np.ndarray:
    stream = engine.add_request(request)
    return np.concatenate([c.codes[c.context:] async for c in stream])


async def run(engine, prompt, others: int, frames: int, sampling: SamplingParams) -> np.ndarray:
    probe = SynthesisRequest(f"probe-{others}", prompt, sampling, frames, seed=1234)
    crowd = [SynthesisRequest(f"o{others}-{i}", prompt, sampling, frames + 5, seed=i) for i in range(others)]
    results = await asyncio.gather(*(codes(engine, r) for r in crowd), codes(engine, probe))
    return results[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--frames", type=int, default=75)
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    model = Qwen3TTS.load(args.checkpoint, device="cuda", dtype="bfloat16", decoder=False, voice=False)
    speaker = sorted(model.config.talker.speakers)[0]
    prompt = build_prompt(model.config, model.tokenizer, "A seeded sentence, the same every time.", speaker=speaker)
    engine = TalkerEngine(model, TalkerEngineConfig(max_num_seqs=256, max_seq_len=512, kv_cache_tokens=256 * 160,
                                                    compile=not args.no_compile))
    engine.start(print)
    report = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "torch": torch.__version__,
              "frames": args.frames, "rows": []}
    try:
        for greedy in (False, True):
            sampling = (SamplingParams(do_sample=False, subtalker_do_sample=False, suppress_eos=True) if greedy
                        else SamplingParams(suppress_eos=True))
            base = None
            for b in [int(x) for x in args.batches.split(",")]:
                got = asyncio.run(run(engine, prompt, b - 1, args.frames, sampling))
                if base is None:
                    base = got
                same = (got == base).all(axis=1)
                first_diff = int(np.argmin(same)) if not same.all() else None
                row = {"sampling": "greedy" if greedy else "sampled", "batch": b,
                       "identical_frames": f"{int(same.sum())}/{len(same)}", "first_differing_frame": first_diff}
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        engine.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
