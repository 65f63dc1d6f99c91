"""A decode step's output on its way to the host.

The step writes one device buffer [rows, 17]: the frame's 16 codes (its first half, the code predictor), then the
next frame's codebook-0 code (its second half, the talker step). Each half's rows cross to the host in one
non-blocking copy into a pinned buffer, followed by an event: the engine hands the frame out once the first half's
copy is there, while the talker half still runs, and reads the rest after the second. Two turns of buffers, so the
engine can launch step N+1 before it reads step N; a turn's buffers are valid until the step after next is launched.
"""

from __future__ import annotations

import numpy as np
import torch

from stages.contract import NUM_CODEBOOKS

HALVES = ("codes", "step")  # the frame's codes; the whole step


class StepCopies:
    def __init__(self, num_slots: int, device: torch.device, cuda: bool):
        self.out = torch.zeros(num_slots, NUM_CODEBOOKS + 1, dtype=torch.long, device=device)
        self._cuda = cuda
        self._host = {half: [torch.zeros(num_slots, NUM_CODEBOOKS + 1, dtype=torch.long, pin_memory=cuda)
                             for _ in range(2)] for half in HALVES}
        self._events = {half: [torch.cuda.Event() if cuda else None for _ in range(2)] for half in HALVES}
        self._turn = 0

    def next_turn(self) -> int:
        turn = self._turn
        self._turn ^= 1
        return turn

    def copy(self, half: str, turn: int, b: int) -> None:
        """Rows [0, b) of `out` (one contiguous block) to the host, once the work enqueued so far has written them
        (for the first half the last column is the previous step's, never read from that copy)."""
        self._host[half][turn][:b].copy_(self.out[:b], non_blocking=True)

    def record(self, half: str, turn: int) -> None:
        if self._cuda:
            self._events[half][turn].record()

    def read(self, half: str, turn: int, n: int) -> np.ndarray:
        """Rows [0, n) of that copy once it is there: [n, 16] codes for "codes", [n, 17] for "step"."""
        if self._cuda:
            self._events[half][turn].synchronize()
        host = self._host[half][turn][:n]
        return (host[:, :NUM_CODEBOOKS] if half == "codes" else host).numpy()
