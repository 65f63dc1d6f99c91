"""`python -m bench.soak` for a few seconds against the session's app: every kind of traffic runs, nothing fails on
the server's side, and the replicas' memory is read."""

from __future__ import annotations

import json
import os

import pytest

from tests.serve.conftest import APP

pytestmark = pytest.mark.serve


def test_a_short_soak_runs_every_kind_of_traffic_without_a_server_error(base_url, tmp_path):
    from bench.soak import main

    out = tmp_path / "soak.json"
    main(["--url", base_url, "--seconds", "6", "--warmup-s", "2", "--concurrency", "3", "--app", APP,
          "--root-pid", str(os.getpid()), "--model", "cv", "--seed", "3", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["requests"] > 0 and report["base_model"] == "base"
    assert report["server_errors"] == 0, report["server_error_samples"]
    assert report["transport_errors"] == 0, report["transport_error_samples"]
    measured = {row["process"] for row in report["rss"] if row["rss_end_mb"]}
    assert {"TTSIngress", "Talker:cv", "Code2Wav", "proxy"} <= measured, measured
