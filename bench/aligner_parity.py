"""Full-size parity of stages/aligner with the official Qwen3-ForcedAligner (qwen-asr 0.0.6), fp32.

    python -m bench.aligner_parity --out docs/results/aligner_parity_full.json [--device cpu]   # from the repo root

Writes a full-size random-weight aligner checkpoint (Qwen3-ForcedAligner-0.6B's shapes, the official layout), runs
the official package on it in its isolated virtualenv (tests/oracle/aligner_venv.py: made on first use, needs PyPI)
and ours on the same batches (the CPU parity test's: English with punctuation and numbers, Chinese, mixed, one to
three waveforms), and compares input ids, timestamp logits at every real position, words and times. Prints and writes
`{"parity_full_size", "max_abs_logit_diff", "words_equal", ...}`. The oracle runs on CPU; `--device` is ours.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from stages.aligner import Aligner
from stages.aligner.random_checkpoint import write_random_aligner
from tests.oracle.aligner_venv import run_asr_oracle
from tests.stages.test_aligner_parity import BATCHES, LENGTHS, _waveform

LOGIT_ATOL = 1e-3  # fp32 over 28 layers; the words must be identical regardless


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    work = args.workdir or Path(tempfile.mkdtemp(prefix="aligner_parity_"))
    t0 = time.perf_counter()
    checkpoint = write_random_aligner(work / "checkpoint", tiny=False, dtype="float32", seed=3, log=print)
    waves = {}
    for i, (name, n) in enumerate(LENGTHS.items()):
        waves[name] = work / f"{name}.npy"
        np.save(waves[name], _waveform(n, seed=i))
    batches = [{"name": name, "audios": [str(waves[w]) for w, _, _ in items], "texts": [t for _, t, _ in items],
                "languages": [lang for _, _, lang in items]} for name, items in BATCHES.items()]
    spec = work / "spec.json"
    spec.write_text(json.dumps({"checkpoint": str(checkpoint), "block_attention": True, "batches": batches}))
    run_asr_oracle("official_aligner.py", "align", str(spec), str(work / "official"), timeout=3600)
    aligner = Aligner.load(checkpoint, device=args.device, dtype="float32")
    rows, worst, all_equal = {}, 0.0, True
    for name, items in BATCHES.items():
        expected = torch.load(work / "official" / f"{name}.pt")
        prepared = aligner.prepare([np.load(waves[w]) for w, _, _ in items], [t for _, t, _ in items],
                                   languages=[lang for _, _, lang in items])
        ids_equal = torch.equal(prepared.input_ids.cpu(), expected["input_ids"])
        logits = aligner.logits(prepared).float().cpu()
        real = expected["attention_mask"].bool()
        diff = (logits[real] - expected["logits"][real]).abs().max().item() if ids_equal else float("inf")
        words = aligner.words(prepared, logits.argmax(-1).to(prepared.input_ids.device))
        ours = [[[w.word, w.start, w.end] for w in row] for row in words]
        theirs = [[list(w) for w in row] for row in expected["words"]]
        equal = ids_equal and ours == theirs
        rows[name] = {"input_ids_equal": ids_equal, "max_abs_logit_diff": diff, "words_equal": equal,
                      "words": sum(len(r) for r in ours)}
        worst, all_equal = max(worst, diff), all_equal and equal
        print(f"{name}: ids {ids_equal}, max |logit diff| {diff:.2e}, words equal {equal}", flush=True)
    result = {
        "parity_full_size": bool(all_equal and worst <= LOGIT_ATOL), "max_abs_logit_diff": worst,
        "words_equal": all_equal, "logit_atol": LOGIT_ATOL, "batches": rows, "device": args.device,
        "dtype": "float32", "host": platform.node(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"), "wall_s": round(time.perf_counter() - t0, 1),
        "command": "python -m bench.aligner_parity " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "batches"}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
