"""bench/priority.py against the session's app, tiny: a batch job alone, real-time arrivals alone, then both; the
report has every field the GPU run records (docs/results/long_form_h200.json, "priority"), the job completes alone
and progresses beside real-time requests, and no real-time request fails."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.serve


def test_a_tiny_priority_run_reports_every_field(base_url, tmp_path):
    out = tmp_path / "priority.json"
    subprocess.run([sys.executable, "-m", "bench.priority", "--url", base_url, "--rate", "1", "--seconds", "4",
                    "--items", "3", "--frames", "6", "--processes", "1", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["job_items_per_s_alone"] > 0 and report["job_items_per_s_beside_realtime"] >= 0
    assert report["ttfa_p95_ms_without_job"] > 0 and report["ttfa_p95_ms_with_job"] > 0
    assert report["failures_without_job"] == report["failures_with_job"] == 0
