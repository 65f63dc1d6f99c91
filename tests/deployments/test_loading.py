"""deployments/loading.py: start-up progress reaches the console whichever way Serve logs."""

from __future__ import annotations

import pytest

from deployments.loading import replica_log, serve_logs_to_stderr


@pytest.mark.parametrize("env, expected", [
    ({}, True),
    ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}, False),
    ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_LOG_TO_STDERR": "1"}, True),
    ({"RAY_SERVE_LOG_TO_STDERR": "0"}, False),
    ({"RAY_SERVE_THROUGHPUT_OPTIMIZED": "true"}, True),  # Serve reads only "1" as true
])
def test_serve_logs_to_stderr_follows_serves_rule(env, expected):
    assert serve_logs_to_stderr(env) is expected


def test_progress_goes_to_stdout_when_serve_does_not_log_to_stderr(monkeypatch, capsys):
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    monkeypatch.delenv("RAY_SERVE_LOG_TO_STDERR", raising=False)
    replica_log("Talker:cv")("capturing graphs 3/21")
    assert capsys.readouterr().out == "[Talker:cv] capturing graphs 3/21\n"
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED")
    replica_log("Talker:cv")("loaded")
    assert capsys.readouterr().out == ""  # Serve's stderr handler shows it; no second copy


def test_triton_cache_goes_beside_the_compile_cache_unless_set():
    from deployments import constants as C
    from deployments.loading import keep_triton_kernels

    env: dict[str, str] = {}
    assert keep_triton_kernels(env) == str(C.TRITON_CACHE_DIR) == env["TRITON_CACHE_DIR"]
    assert C.TRITON_CACHE_DIR.parent == C.COMPILE_CACHE_DIR
    mine = {"TRITON_CACHE_DIR": "/somewhere/else"}
    assert keep_triton_kernels(mine) == "/somewhere/else"
