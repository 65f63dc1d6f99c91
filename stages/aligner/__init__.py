"""Qwen3-ForcedAligner in plain PyTorch: word timestamps for audio and its transcript (see aligner.py).

`Aligner` (torch) is imported on first use, so that `Word` and the torch-free modules (`timestamps`, `words`) serve
code without torch, as the Serve ingress and application builder are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stages.aligner.timestamps import Word

if TYPE_CHECKING:
    from stages.aligner.aligner import Aligner

__all__ = ["Aligner", "Word"]


def __getattr__(name: str):
    if name == "Aligner":
        from stages.aligner.aligner import Aligner

        return Aligner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
