"""Wait until `GET /ready` answers 200 (every deployment warmed up), or fail fast when the server died.

    python -m bench.loadgen.ready --url http://127.0.0.1:8000 --timeout 420 --pid "$(cat serve.pid)" \
        --log serve.log --fail-on "Failed to update the deployments"

Exit status: 0 ready, 1 timed out, 2 the process `--pid` exited first, 3 `--log` shows a `--fail-on` line
(a replica constructor raised: Serve would retry it forever).

`--warm-begin B --warm-end E` (with `--log`): after ready, also wait (within the timeout) until the log has as many
lines matching E as lines matching B, and print "warm after N s": work a replica starts after it is ready (the
Talker's first-chunk decoder, deployments/talker/first_chunk_decoder.py) has ended, so that a measurement of first
audio sees the served path at its fastest. Not warm within the timeout is reported, not a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 0.5
REPORT_EVERY_S = 30.0


def probe(url: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/ready", timeout=10) as r:
            return r.status, r.read(500).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(500).decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        return None, str(e)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def failure_line(log: Path | None, patterns: list[str]) -> str | None:
    if log is None or not patterns or not log.exists():
        return None
    for line in log.read_text(errors="replace").splitlines():
        if any(p in line for p in patterns):
            return line
    return None


def wait_ready(url: str, timeout_s: float, pid: int | None = None, log: Path | None = None,
               fail_on: list[str] = ()) -> int:
    start = last_report = time.monotonic()
    while True:
        status, body = probe(url)
        elapsed = time.monotonic() - start
        if status == 200:
            print(f"ready after {elapsed:.0f} s: {body}", flush=True)
            return 0
        if pid is not None and not alive(pid):
            print(f"server process {pid} exited after {elapsed:.0f} s without becoming ready", flush=True)
            return 2
        if (line := failure_line(log, list(fail_on))) is not None:
            print(f"deployment failed after {elapsed:.0f} s: {line[:500]}", flush=True)
            return 3
        if elapsed > timeout_s:
            print(f"not ready after {timeout_s:.0f} s: {status} {body}", flush=True)
            return 1
        if time.monotonic() - last_report >= REPORT_EVERY_S:
            last_report = time.monotonic()
            print(f"waiting for /ready ({elapsed:.0f} s): {status} {body[:300]}", flush=True)
        time.sleep(POLL_S)  # polling a remote endpoint: nothing to await


def wait_warm(log: Path, begin: str, end: str, start: float, timeout_s: float) -> bool:
    """After ready: until `log` has as many `end` lines as `begin` lines (regular expressions)."""
    import re

    b, e = re.compile(begin), re.compile(end)
    while True:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        begun, ended = sum(bool(b.search(x)) for x in lines), sum(bool(e.search(x)) for x in lines)
        elapsed = time.monotonic() - start
        if ended >= begun:
            print(f"warm after {elapsed:.0f} s ({ended} of {begun} begun ended)", flush=True)
            return True
        if elapsed > timeout_s:
            print(f"not warm after {timeout_s:.0f} s ({ended} of {begun} begun ended)", flush=True)
            return False
        time.sleep(POLL_S)  # a file another process appends to: nothing to await


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--timeout", type=float, default=420.0)
    ap.add_argument("--pid", type=int, default=None, help="fail as soon as this process exits")
    ap.add_argument("--log", type=Path, default=None, help="the server's log, scanned for --fail-on")
    ap.add_argument("--fail-on", action="append", default=[], help="a log substring that means failure")
    ap.add_argument("--warm-begin", default=None, help="a log regex: a replica began work after ready")
    ap.add_argument("--warm-end", default=None, help="a log regex: that work ended (see above)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    rc = wait_ready(args.url, args.timeout, args.pid, args.log, args.fail_on)
    if rc == 0 and args.log is not None and args.warm_begin and args.warm_end:
        wait_warm(args.log, args.warm_begin, args.warm_end, start, args.timeout)
    return rc


if __name__ == "__main__":
    sys.exit(main())
