"""bench/aligner_first_forward.py runs end to end on CPU with a tiny aligner and reports every forward."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from stages.aligner.random_checkpoint import write_random_aligner

REPO = Path(__file__).resolve().parents[2]


def test_it_reports_the_warm_up_and_each_forward(tmp_path):
    path = write_random_aligner(tmp_path / "aligner", tiny=True, dtype="float32", log=lambda *_: None)
    out = subprocess.run([sys.executable, "-m", "bench.aligner_first_forward", "--checkpoint", str(path),
                          "--device", "cpu", "--pieces", "2,1", "--seconds", "1.5", "--max-pieces", "4",
                          "--max-audio-s", "20"], cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert "warm_up_s" in lines[0]
    assert [(r["forward"], r["pieces"]) for r in lines[1:]] == [(0, 2), (1, 1)]
    assert all(0 < r["front_end_ms"] <= r["ms"] for r in lines[1:])
