"""A refcounted switch that routes aten ops to the project's own kernels while it is on (deterministic mode's
batch-invariant convolutions: stages/invariant_conv.py)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


class AtenOverride:
    """`register()` builds the `torch.library.Library` objects holding the overrides (their registrations live as
    long as the objects); the first `enable()` builds them, the matching last `disable()` destroys them, which
    restores aten's kernels. Thread-safe; process-wide, as the dispatcher is."""

    def __init__(self, name: str, register: Callable[[], list[torch.library.Library]]):
        self._name, self._register = name, register
        self._lock = threading.Lock()
        self._libraries: list[torch.library.Library] = []
        self._users = 0

    def enable(self) -> None:
        with self._lock:
            if self._users == 0:
                self._libraries = self._register()
            self._users += 1

    def disable(self) -> None:
        with self._lock:
            if self._users == 0:
                raise RuntimeError(f"{self._name}.disable() without a matching enable()")
            self._users -= 1
            if self._users == 0:
                for lib in self._libraries:
                    lib._destroy()
                self._libraries = []

    def enabled(self) -> bool:
        return self._users > 0

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        self.enable()
        try:
            yield
        finally:
            self.disable()
