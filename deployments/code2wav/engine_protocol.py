"""What Code2WavServer needs of a Code2Wav engine: the seam between the Serve shim and `stages.code2wav.engine`.

`stages.code2wav.engine.Code2WavEngine` is the production engine (tests/deployments/test_engine_protocols.py checks
it). An engine is named by `engine_cls: "module:Class"` and built with its `config_cls` from `engine_kwargs`
(deployments/loading.py). Members are plain attributes and methods: the server calls them without probing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from stages.contract import CodecChunk


class Code2WavEngineSettings(Protocol):
    state_slots: int  # stateful: streams whose decoder state is kept


class Code2WavEngineCounters(Protocol):
    """The counters the server turns into metrics (`Code2WavMetrics.record_state_paths`)."""

    continued: int  # stateful: chunks decoded from their stream's state
    fresh: int  # stateful: chunks decoded from zero state over their context


@runtime_checkable
class Code2WavEngineProtocol(Protocol):
    config: Code2WavEngineSettings
    stateful: bool  # keeps each stream's decoder state between its chunks

    def warmup(self, log: Callable[[str], None]) -> float:
        """Graph capture (CUDA); returns its seconds."""

    def check_chunk(self, chunk: CodecChunk, index: int = 0) -> None:
        """Raise ValueError for a chunk this engine cannot decode (the server fails it alone)."""

    def decode(self, chunks: list[CodecChunk], checked: bool = False) -> list[np.ndarray]:
        """Float waves of each chunk's new frames, in order (blocking: on the server's decoder thread)."""

    def stats(self) -> Code2WavEngineCounters: ...
