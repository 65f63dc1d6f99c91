"""What AlignerServer needs of a forced aligner: the seam between the Serve shim and `stages.aligner`.

`stages.aligner.aligner.Aligner` is the production engine (tests/deployments/test_engine_protocols.py checks it);
tests use a fake behind this Protocol. Members are plain attributes and methods: the server calls them without
probing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from stages.aligner.timestamps import Word


@runtime_checkable
class AlignerEngineProtocol(Protocol):
    max_seconds: float  # the longest waveform `align` times

    def min_samples(self, sample_rate: int) -> int:
        """The fewest samples at `sample_rate` that `align` takes."""

    def align(self, audios: list[np.ndarray], texts: list[str], sample_rate: int,
              languages: list[str] | None = None) -> list[list[Word]]:
        """Mono float waveforms and their transcripts -> per pair its words with times in seconds (blocking: on the
        server's aligner thread). Raises ValueError for a waveform or language it refuses (the whole call)."""
