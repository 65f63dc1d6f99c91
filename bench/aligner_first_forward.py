"""The Aligner's first forwards after its warm-up: does a request's wait pay one-time work?

    python -m bench.aligner_first_forward --checkpoint /tmp/aligner-0.6b --pieces 6,2,3,12

Loads the aligner as a served replica does (bf16, compiled kernels, CUDA graphs), runs the server's warm-up, then
forwards of `--pieces` six-second pieces in that order, each timed (front end = spectrogram and prompts, then the
whole forward). While a forward runs, every `--stack-every` seconds Python's faulthandler writes every thread's stack
to stderr: a forward that stalls shows the line it stalled on. Prints one JSON line per forward. Run it first on a
fresh machine: kernels PyTorch compiles at run time are kept in a cache on disk (`~/.cache/torch/kernels`), so a
second process may not pay what the first one did.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="an aligner checkpoint (python -m stages.aligner.random_checkpoint)")
    ap.add_argument("--pieces", default="6,2,3,12", help="pieces per forward, in order")
    ap.add_argument("--seconds", type=float, default=6.0, help="each piece's length")
    ap.add_argument("--stack-every", type=float, default=0.4)
    ap.add_argument("--max-pieces", type=int, default=32, help="the warm-up's batch bound (the server's)")
    ap.add_argument("--max-audio-s", type=float, default=480.0, help="the warm-up's audio bound (the server's)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (fp32, no graphs)")
    args = ap.parse_args()

    import torch

    from stages.aligner import Aligner

    cuda = args.device == "cuda"
    aligner = Aligner.load(args.checkpoint, device=args.device, dtype="bfloat16" if cuda else "float32")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    aligner.warm_up(args.max_pieces, args.max_audio_s)
    sync()
    print(json.dumps({"warm_up_s": round(time.perf_counter() - t0, 1),
                      "module_loading": os.environ.get("CUDA_MODULE_LOADING", "LAZY (default)")}), flush=True)
    rng = np.random.default_rng(7)
    sample_rate = 24000
    for i, n in enumerate(int(p) for p in args.pieces.split(",")):
        pieces = [aligner.prepare_piece((rng.standard_normal(int(args.seconds * sample_rate)) * 0.1).astype(np.float32),
                                        "the quick brown fox jumps over a lazy dog", sample_rate) for _ in range(n)]
        sync()
        t = time.perf_counter()
        faulthandler.dump_traceback_later(args.stack_every, repeat=True, file=sys.stderr)
        try:
            batch = aligner.batch(pieces)
            sync()
            front = time.perf_counter()
            aligner.words(batch, aligner.logits(batch).argmax(dim=-1))
            sync()
        finally:
            faulthandler.cancel_dump_traceback_later()
        print(json.dumps({"forward": i, "pieces": n, "front_end_ms": round((front - t) * 1e3, 1),
                          "ms": round((time.perf_counter() - t) * 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
