"""What AlignerServer needs of a forced aligner: the seam between the Serve shim and `stages.aligner`.

`stages.aligner.aligner.Aligner` is the production engine (tests/deployments/test_engine_protocols.py checks it);
tests use a fake behind this Protocol. Members are plain attributes and methods: the server calls them without
probing.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from stages.aligner.timestamps import Word


@runtime_checkable
class AlignerEngineProtocol(Protocol):
    max_seconds: float  # the longest waveform it times

    def min_samples(self, sample_rate: int) -> int:
        """The fewest samples at `sample_rate` that `prepare_piece` takes."""

    def prepare_piece(self, audio: np.ndarray, text: str, sample_rate: int, language: str = "") -> Any:
        """One waveform and its transcript made ready for `align_prepared`, on the host (thread-safe: the server
        runs it on several threads as pieces arrive). Raises ValueError for a waveform it refuses."""

    def warm_up(self, max_pieces: int, max_audio_s: float) -> int:
        """One-time costs paid before serving forwards of up to `max_pieces` pieces and `max_audio_s` seconds of
        padded audio (blocking: on the server's device thread). -> graphs captured (0 without)."""

    def one_time_work(self) -> dict[str, int]:
        """Counts of one-time work done so far, each one a request waited for when it moves after `warm_up`:
        "graphs" (CUDA graphs captured: a shape the warm-up missed), "traces" (functions torch.compile traced in
        this process), "kernels" (Triton kernels JIT-compiled in this process: a new specialization),
        "conv_shapes" (distinct shapes the eager audio convolutions met: each a new cuDNN problem),
        "spectrogram_shapes" (distinct spectrogram shapes: on CUDA each a new cuFFT plan)."""

    def align_prepared(self, pieces: list[Any]) -> list[list[Word]]:
        """One batched forward of prepared pieces -> per piece its words with times in seconds (blocking: on the
        server's device thread). Raises ValueError for a piece it refuses (the whole call)."""
