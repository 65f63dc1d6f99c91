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


def test_progress_goes_to_stdout_when_serve_does_not_log_to_stderr(monkeypatch, capfd):
    """As in a replica of throughput-optimized Serve, which sends `print` and `sys.stdout` to its own logger (a
    buffer and a file, never the console): the line must reach the process's stdout, which Ray forwards."""
    import builtins
    import logging
    import sys

    from ray.serve._private.logging_utils import StreamToLogger, redirected_print

    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    monkeypatch.delenv("RAY_SERVE_LOG_TO_STDERR", raising=False)
    with monkeypatch.context() as serve_redirection:
        serve_redirection.setattr(builtins, "print", redirected_print)
        serve_redirection.setattr(sys, "stdout", StreamToLogger(logging.getLogger("ray.serve"), logging.INFO, sys.stdout))
        replica_log("Talker:cv")("capturing graphs 3/21")
    assert capfd.readouterr().out == "[Talker:cv] capturing graphs 3/21\n"
    monkeypatch.delenv("RAY_SERVE_THROUGHPUT_OPTIMIZED")
    replica_log("Talker:cv")("loaded")
    assert capfd.readouterr().out == ""  # Serve's stderr handler shows it; no second copy


def test_triton_cache_goes_beside_the_compile_cache_unless_set():
    from deployments import constants as C
    from deployments.loading import keep_triton_kernels

    env: dict[str, str] = {}
    assert keep_triton_kernels(env) == str(C.TRITON_CACHE_DIR) == env["TRITON_CACHE_DIR"]
    assert C.TRITON_CACHE_DIR.parent == C.COMPILE_CACHE_DIR
    mine = {"TRITON_CACHE_DIR": "/somewhere/else"}
    assert keep_triton_kernels(mine) == "/somewhere/else"


def _package(root, name: str):
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("VALUE = 42\n")
    return root / name


def test_bytecode_of_a_package_installed_without_it_is_kept_in_the_cache_dir(tmp_path, monkeypatch):
    """keep_bytecode: a package with no bytecode where Python looks (uv's default install) under
    PYTHONDONTWRITEBYTECODE=1 (container images) is compiled once into the cache dir and read from there after."""
    import importlib
    import sys

    from deployments.loading import keep_bytecode

    site = tmp_path / "site"
    site.mkdir()
    pkg = _package(site, "nobytecode_pkg")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    importlib.invalidate_caches()
    cache = tmp_path / "pycache"
    assert keep_bytecode("nobytecode_pkg", "off") is None and sys.pycache_prefix is None
    assert keep_bytecode("nobytecode_pkg", str(cache)) == str(cache)
    assert sys.pycache_prefix == str(cache) and not sys.dont_write_bytecode
    monkeypatch.delitem(sys.modules, "nobytecode_pkg", raising=False)
    assert importlib.import_module("nobytecode_pkg").VALUE == 42
    written = list(cache.rglob("*.pyc"))
    assert len(written) == 1 and written[0].parent == cache / str(pkg).lstrip("/")  # a mirror of the source tree
    assert not (pkg / "__pycache__").exists()  # the installed package untouched
    assert keep_bytecode("nobytecode_pkg", str(tmp_path / "other")) is None  # a prefix is set: left alone


def test_bytecode_is_left_alone_where_the_package_has_it(tmp_path, monkeypatch):
    import py_compile
    import sys

    from deployments.loading import keep_bytecode

    pkg = _package(tmp_path, "withbytecode_pkg")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    py_compile.compile(str(pkg / "__init__.py"))  # as pip installs it
    monkeypatch.syspath_prepend(str(tmp_path))
    assert keep_bytecode("withbytecode_pkg", str(tmp_path / "pycache")) is None
    assert sys.pycache_prefix is None
    assert keep_bytecode("no_such_package_here", str(tmp_path / "pycache")) is None
