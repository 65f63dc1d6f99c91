"""Qwen3-ForcedAligner in plain PyTorch: word timestamps for audio and its transcript (see aligner.py)."""

from stages.aligner.aligner import Aligner
from stages.aligner.timestamps import Word

__all__ = ["Aligner", "Word"]
