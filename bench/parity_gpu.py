"""Full-size parity with the official qwen-tts on a GPU (run on the GPU machine, once per change).

    PYTHONPATH_ORACLE=/tmp/oracle_site python -m bench.parity_gpu --checkpoint DIR --out OUT.json   # from the repo root

Loads the checkpoint in fp32 on both sides (TF32 off), runs the official package greedily with EOS
suppressed for 40 frames in a subprocess (its transformers 4.57.3 from PYTHONPATH_ORACLE), then our
reference generator; compares codes exactly and teacher-forced talker/code-predictor logits.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.reference import ReferenceGenerator
from tests.stages.test_parity_generate import FRAMES, GREEDY, JOBS, TEXT, _teacher_forced_logits

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--workdir", default="/tmp/parity")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = ["cv_auto", "cv_english_instruct", "cv_streaming_text"]
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    spec = {"checkpoint": args.checkpoint, "device": "cuda", "dtype": "float32",
            "jobs": [{"name": n, "text": TEXT, "frames": FRAMES, **JOBS[n]} for n in names]}
    (work / "jobs.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=f"{os.environ['PYTHONPATH_ORACLE']}:{ROOT / 'tests' / 'oracle'}",
               HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, str(ROOT / "tests/oracle/official_generate.py"), str(work / "jobs.json"),
                    str(work / "official")], check=True, env=env)
    model = Qwen3TTS.load(args.checkpoint, device="cuda", dtype="float32", voice=False)
    rows = []
    for n in names:
        ref = torch.load(work / "official" / f"{n}.pt")
        job = JOBS[n]
        prompt = build_prompt(model.config, model.tokenizer, TEXT, speaker=job.get("speaker"),
                              language=job.get("language"), instruct=job.get("instruct"),
                              non_streaming_text=job.get("non_streaming_mode"))
        codes = ReferenceGenerator(model).generate_codes(prompt, GREEDY, FRAMES)
        theirs = ref["codes"].numpy()
        tl, cl = _teacher_forced_logits_cuda(model, prompt, ref["codes"])
        wav = ReferenceGenerator(model).decode(theirs)
        rows.append({
            "job": n, "frames": int(theirs.shape[0]), "codes_identical": bool(np.array_equal(codes, theirs)),
            "first_diff_frame": None if np.array_equal(codes, theirs) else int(np.argwhere(codes != theirs)[0][0]),
            "talker_logits_max_abs": float((tl - ref["talker_logits"]).abs().max()),
            "cp_logits_max_abs": float((cl - ref["cp_logits"]).abs().max()),
            "waveform_max_abs": float(np.abs(wav - ref["wav"].numpy()).max()),
        })
        print(json.dumps(rows[-1]), flush=True)
    report = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "command": " ".join(["python -m bench.parity_gpu", *sys.argv[1:]]), "dtype": "float32 (TF32 off)",
              "checkpoint": args.checkpoint, "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))


def _teacher_forced_logits_cuda(model, prompt, codes):
    tl, cl = _teacher_forced_logits(model, prompt, codes.to(model.device))
    return tl.float().cpu(), cl.float().cpu()


if __name__ == "__main__":
    main()
