"""Progress while a load point runs: tqdm on a terminal, else one plain line every few seconds (logs)."""

from __future__ import annotations

import sys
import time
from typing import Literal, Protocol

Style = Literal["auto", "tqdm", "plain", "none"]
PLAIN_EVERY_S = 5.0


class Progress(Protocol):
    def update(self, ok: bool, inflight: int) -> None: ...
    def close(self) -> None: ...


class _Silent:
    def update(self, ok: bool, inflight: int) -> None:
        pass

    def close(self) -> None:
        pass


class _Tqdm:
    def __init__(self, label: str, total: int):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True)
        self.failed = 0

    def update(self, ok: bool, inflight: int) -> None:
        self.failed += not ok
        self.bar.set_postfix(failed=self.failed, inflight=inflight, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


class _Plain:
    def __init__(self, label: str, total: int):
        self.label, self.total, self.done, self.failed = label, total, 0, 0
        self.started = self.last = time.monotonic()

    def update(self, ok: bool, inflight: int) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        if now - self.last >= PLAIN_EVERY_S or self.done == self.total:
            self.last = now
            print(f"[{self.label}] {self.done}/{self.total} done, {self.failed} failed, {inflight} in flight, "
                  f"{now - self.started:.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def make_progress(style: Style, label: str, total: int) -> Progress:
    if style == "none":
        return _Silent()
    if style == "auto":
        style = "tqdm" if sys.stderr.isatty() and _has_tqdm() else "plain"
    if style == "tqdm" and _has_tqdm():
        return _Tqdm(label, total)
    return _Plain(label, total)


def _has_tqdm() -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True
