"""DecodeQueue: the chunks waiting in a Code2Wav replica, decoded earliest playback deadline first, in engine
calls of bounded size.

Before, the replica decoded every chunk waiting when its decoder thread came free, in one engine call. Under
load (four ingress replicas with four calls of 64 chunks each in flight) such a call held hundreds of steady
chunks, each seconds ahead of its listener, and a new stream's first chunk that arrived meanwhile waited for
all of them and then for its own call. (At 256 streams on an H100 the Talker handed out first chunks 93 ms
after their requests reached it while clients heard first audio after 534 ms; docs/benchmarks.md measures
what this queue changes.)

Here each chunk gets the time its stream's player reaches it: the stream's first chunk at this replica
starts the player (a first chunk is due when it arrives), and a later chunk is due when the audio of the
stream's earlier chunks has played (`audio before / real time`). A live stream that paused has a deadline in
the past, so it is urgent again. `take` hands out the earliest deadlines first, up to `max_call_frames`
frames of decoding (at least one chunk), so no call is long enough to hide a first chunk behind it. Chunks of
one stream keep their order (their deadlines grow with their audio; ties go by arrival), which the stateful
engine needs.

Torch-free, not thread-safe: the replica's event loop owns it. Streams are remembered until their final chunk,
at most `max_streams` of them (least recently seen forgotten first: a client that left never sends one).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from stages.contract import CodecChunk

T = TypeVar("T")

FRAME_S = 0.08  # seconds of audio per codec frame


@dataclass
class _Stream:
    started: float  # when its first chunk reached this replica: the player's start
    audio_s: float = 0.0  # audio of the chunks queued so far


class DecodeQueue(Generic[T]):
    def __init__(self, max_call_frames: int, cost: Callable[[CodecChunk], int] | None = None,
                 max_streams: int = 8192, clock: Callable[[], float] = time.monotonic):
        """`cost(chunk)`: frames the engine decodes for it (default: context + new)."""
        if max_call_frames < 1 or max_streams < 1:
            raise ValueError("max_call_frames and max_streams must be >= 1")
        self.max_call_frames, self.max_streams = max_call_frames, max_streams
        self._cost = cost or (lambda c: int(c.codes.shape[0]))
        self._clock = clock
        self._heap: list[tuple[float, int, int, T]] = []  # (deadline, arrival, cost, item)
        self._arrival = itertools.count()
        self._streams: OrderedDict[str, _Stream] = OrderedDict()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, chunk: CodecChunk, item: T) -> float:
        """Queue `item` (what `take` returns) for `chunk`; returns the chunk's deadline."""
        stream = self._streams.get(chunk.request_id)
        if stream is None:
            stream = self._streams[chunk.request_id] = _Stream(self._clock())
            if len(self._streams) > self.max_streams:
                self._streams.popitem(last=False)
        else:
            self._streams.move_to_end(chunk.request_id)
        deadline = stream.started + stream.audio_s
        stream.audio_s += chunk.num_new * FRAME_S
        if chunk.final:
            del self._streams[chunk.request_id]
        heapq.heappush(self._heap, (deadline, next(self._arrival), self._cost(chunk), item))
        return deadline

    def take(self) -> list[T]:
        """The most urgent items, `max_call_frames` frames of decoding together at most (the first one always)."""
        out: list[T] = []
        frames = 0
        while self._heap:
            cost = self._heap[0][2]
            if out and frames + cost > self.max_call_frames:
                break
            out.append(heapq.heappop(self._heap)[3])
            frames += cost
        return out
