"""StreamSlots: which decoder-state slot holds which stream, and whether a chunk can continue from it.

Torch-free bookkeeping for the stateful Code2Wav engine (stages/code2wav/stateful.py). A chunk continues
its stream's state when the slot's state is exactly "after chunk seq - 1"; anything else (the stream's
first chunk, a chunk that went to another replica, an evicted or late stream) decodes `fresh`: from zero
state over its own left-context frames, which is the stateless decode. So a missed state costs fidelity
no worse than stateless decoding, never correctness.

Slots are bounded (`num_slots`); the least recently used stream gives its slot up when a new one needs it
(a client that left mid-stream never sends its final chunk). A final chunk frees its slot after the call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from stages.contract import CodecChunk


@dataclass(frozen=True, slots=True)
class SlotRow:
    """How one chunk is decoded: `slot` (or the scratch slot), `fresh` (zero state, context frames decoded
    too) or continued (new frames only), and its `wave`: chunks of one stream in one call run in order."""

    slot: int
    fresh: bool
    wave: int

    def start(self, chunk: CodecChunk) -> int:
        """First frame of `chunk.codes` to decode (a continued chunk skips its context)."""
        return 0 if self.fresh else chunk.context

    def offset(self, chunk: CodecChunk) -> int:
        """Frames decoded before the chunk's new ones (their samples are not returned)."""
        return chunk.context if self.fresh else 0


@dataclass
class _Entry:
    slot: int
    next_seq: int


class StreamSlots:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self.scratch = num_slots  # the state row nobody reads
        self._free = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._streams: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self.counts = dict(continued=0, fresh=0, evicted=0, late=0)

    def __len__(self) -> int:
        return len(self._streams)

    def assign(self, chunks: list[CodecChunk]) -> list[SlotRow | None]:
        """A SlotRow per chunk (None: no new frames, nothing to decode), in order. Then call `release(chunks)`
        once their decode is done (or failed)."""
        rows: list[SlotRow | None] = []
        waves: dict[str, int] = {}
        in_use: set[int] = set()
        for chunk in chunks:
            if chunk.num_new <= 0:
                rows.append(None)
                continue
            wave = waves.get(chunk.request_id, 0)
            waves[chunk.request_id] = wave + 1
            entry = self._streams.get(chunk.request_id)
            if entry is not None and chunk.seq == entry.next_seq:
                self._streams.move_to_end(chunk.request_id)
                entry.next_seq += 1
                self.counts["continued"] += 1
                rows.append(SlotRow(entry.slot, False, wave))
                in_use.add(entry.slot)
                continue
            self.counts["fresh"] += 1
            if entry is not None and chunk.seq < entry.next_seq:  # late: the state is already past it
                self.counts["late"] += 1
                rows.append(SlotRow(self.scratch, True, wave))
                continue
            if entry is None:
                slot = self._take_slot(in_use)
                if slot is None:  # every slot serves this call: decode without keeping state
                    rows.append(SlotRow(self.scratch, True, wave))
                    continue
                entry = self._streams[chunk.request_id] = _Entry(slot, chunk.seq)
            self._streams.move_to_end(chunk.request_id)
            entry.next_seq = chunk.seq + 1
            rows.append(SlotRow(entry.slot, True, wave))
            in_use.add(entry.slot)
        return rows

    def release(self, chunks: list[CodecChunk]) -> None:
        """Free the slots of streams whose final chunk was in this call."""
        for chunk in chunks:
            if chunk.final:
                self.forget(chunk.request_id)

    def forget(self, request_id: str) -> None:
        entry = self._streams.pop(request_id, None)
        if entry is not None:
            self._free.append(entry.slot)

    def _take_slot(self, in_use: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for request_id, entry in self._streams.items():  # least recently used first
            if entry.slot not in in_use:
                del self._streams[request_id]
                self.counts["evicted"] += 1
                return entry.slot
        return None
