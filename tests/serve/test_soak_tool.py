"""bench/soak.py against the session's app for a few seconds: mixed traffic (every format, streams, SSE,
WebSocket contexts, voice upload/use/delete, batch jobs, client disconnects) with no 5xx, and the Serve processes' memory
sampled (the 30-minute soak itself is a benchmark: docs/results.md, "Soak")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.serve


def test_a_short_soak_has_no_server_errors_and_samples_memory(base_url, tmp_path):
    out = tmp_path / "soak.json"
    subprocess.run([sys.executable, "-m", "bench.soak", "--url", base_url, "--minutes", "0.2", "--concurrency", "3",
                    "--frames", "6", "--disconnect", "0.3", "--warmup-s", "0", "--sample-s", "4", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["requests"] > 0 and report["errors_5xx"] == 0, report["failures"]
    assert set(report["by_kind"]) <= {"whole", "stream", "sse", "websocket", "voice", "batch"}
    if "batch" in report["by_kind"]:  # jobs submitted: each item downloaded, cancelled or counted unfinished
        assert set(report["batch_items"]) <= {"downloaded", "cancelled", "unfinished_at_end"}, report["batch_items"]
    assert any(k.startswith("ray::ServeReplica") for k in report["samples"][-1]["rss_mib"])
