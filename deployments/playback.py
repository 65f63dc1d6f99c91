"""Server-side estimate of a streaming client's buffer: a player that starts at the first byte.

The player plays in real time from the moment the first audio byte is sent. Before each later send,
`lead` = audio already sent - playback time elapsed; a negative lead is an underrun (the listener
heard a gap). Network time is not included: this is the server's contribution to continuity.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class PlaybackClock:
    started: float | None = None  # monotonic time of the first byte
    audio_s: float = 0.0  # audio sent so far
    min_lead_s: float = float("inf")
    underruns: int = 0
    underrun_s: float = 0.0  # total silence the player waited through
    _in_underrun: bool = field(default=False, repr=False)

    def sent(self, audio_seconds: float, now: float | None = None) -> None:
        """Record `audio_seconds` of audio handed to the client at `now`."""
        now = time.monotonic() if now is None else now
        if self.started is None:
            self.started = now
        else:
            lead = self.audio_s - (now - self.started)
            self.min_lead_s = min(self.min_lead_s, lead)
            if lead < 0 and not self._in_underrun:
                self.underruns += 1
            self._in_underrun = lead < 0
            if lead < 0:  # the player waited: it restarts from this chunk
                self.started -= lead
                self.underrun_s -= lead
        self.audio_s += audio_seconds
