"""Subprocess helpers shared by the tests that start `serve run` themselves."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(process: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGINT the process group (serve run shuts Serve down cleanly), SIGKILL it if it lingers."""
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
