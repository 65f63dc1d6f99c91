"""A live request's text on the engine side: what the streaming-text layout can take now (torch-free).

In the streaming-text layout the talker reads one position of a *text track* per frame. The track is the
reference transcript (Base ICL only), the text ids, then `tts_eos` once the text is complete, then `tts_pad`
forever (stages/talker/prefill.py, §2.3 of the model brief). The prefill takes the first `n_prefill` track
positions (the first text id; ICL: as many as the reference has frames + 1), and the step that produces
frame f of a segment reads position `n_prefill + f` (its "trailing" row f). So with text arriving late:
- a segment can be prefilled once its track reaches `n_prefill` positions (or its text is closed: then the
  layout pads it exactly like a whole short text);
- the step for frame f can run once trailing row f is known, i.e. `f < len(track) - n_prefill`, or the text
  is closed (rows past the eos are tts_pad). Otherwise the request waits (the engine parks it).
The rows a request reads are therefore those of the same text sent whole: same codes (greedy, fp32).

Segments: `flush` closes the current segment as if the text ended there (its eos row follows its last id, then
tts_pad, and the model speaks it to its end: codec EOS). Text after a flush is the next segment, spoken after
it on the same stream as a whole utterance of its own: a new prefill of the same prompt with that text, in the
request's row, KV blocks and frame budget (`max_frames` counts all segments).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field, replace

import numpy as np

from stages.contract import TalkerPrompt
from stages.text_stream import TextPiece

UNLIMITED = np.iinfo(np.int64).max // 4  # text limit of a request whose text is complete (or not live)


@dataclass
class Segment:
    track: list[int]  # text-track ids: reference transcript (ICL) + this segment's text ids so far
    role_ids: tuple[int, ...]
    closed: bool = False  # its text is complete (flush or end): eos, then tts_pad, after the track


@dataclass
class LiveText:
    """Text of one live request as it arrives. Engine thread only."""

    prompt: TalkerPrompt  # the request's prompt, without text (voice, language, instruction)
    eos_id: int  # tts_eos, the track position after a closed segment's text
    last_text_at: float  # monotonic time of the last text received (the idle timeout counts from here)
    idle_timeout_s: float  # waiting this long for text ends the request (TextTimeoutError)
    segments: collections.deque[Segment] = field(default_factory=collections.deque)
    first_segment: int = 0  # number of segments[0]
    ended: bool = False  # `end` received: no segment follows the last one
    had_text: bool = False
    frame_base: int = 0  # frames the request produced before its current segment
    written: int = 0  # trailing rows of the current segment written to the device row
    waiting_since: float | None = None  # set while the request waits for text (held or parked)
    seed: int = 0  # the request's seed (each segment derives its own)
    opened_at: float = field(default_factory=time.monotonic)  # the lifetime bound counts from here

    @property
    def ref_ids(self) -> tuple[int, ...]:
        voice = self.prompt.voice
        return tuple(voice.ref_text_ids or ()) if voice is not None and voice.icl else ()

    @property
    def n_prefill(self) -> int:
        """Track positions the prefill takes: the first text id, or (ICL) one per reference frame + 1."""
        voice = self.prompt.voice
        return int(voice.ref_codes.shape[0]) + 1 if voice is not None and voice.icl else 1

    @property
    def current(self) -> Segment | None:
        return self.segments[0] if self.segments else None

    def add(self, piece: TextPiece) -> None:
        self.ended = self.ended or piece.ended
        k = piece.segment - self.first_segment
        if k == len(self.segments):
            if not piece.ids and piece.closed:  # an empty last segment (end without text): nothing to speak
                return
            self.segments.append(Segment(list(self.ref_ids), piece.role_ids or self.prompt.role_ids))
        seg = self.segments[k]
        seg.track += piece.ids
        seg.closed = seg.closed or piece.closed
        self.had_text = self.had_text or bool(piece.ids)

    def next_segment(self, frames: int) -> None:
        """The current segment was spoken to its end; the next one (if any) starts at frame `frames`."""
        self.segments.popleft()
        self.first_segment += 1
        self.frame_base, self.written = frames, 0

    @property
    def finished(self) -> bool:
        """Nothing left to speak, nothing more to come."""
        return self.ended and not self.segments

    def speaks_on_after_eos(self) -> bool:
        """A codec EOS ends only the current segment, not the request: a flush closed it, and the text did not
        end with it."""
        seg = self.current
        return seg is not None and seg.closed and not (self.ended and len(self.segments) == 1)

    def can_prefill(self) -> bool:
        seg = self.current
        return seg is not None and (seg.closed or len(seg.track) >= self.n_prefill)

    def prefill_prompt(self) -> TalkerPrompt:
        """The current segment's prompt for its prefill: the text ids the prefill rows take (all when closed)."""
        seg = self.current
        ids = seg.track[len(self.ref_ids):]
        if not seg.closed:  # the prefill's rows only; the rest arrives as trailing rows
            ids = ids[:max(self.n_prefill - len(self.ref_ids), 0)]
        return replace(self.prompt, text_ids=tuple(ids), role_ids=seg.role_ids, non_streaming_text=False)

    def take_trailing(self) -> tuple[int, list[int]]:
        """(first row, ids) of the current segment's trailing rows known now and not written yet; they count as
        written. Rows past a closed segment's eos are tts_pad (the runner's default past the trailing length)."""
        seg, start = self.current, self.written
        at = self.n_prefill + start
        ids = seg.track[at:]
        if seg.closed and at <= len(seg.track):  # its eos row (unless the prefill took it: ICL, short text)
            ids.append(self.eos_id)
        self.written = start + len(ids)
        return start, ids

    def longest_trailing(self) -> int:
        """Trailing rows the longest segment needs so far (the device holds `max_text_rows` per row)."""
        return max((len(seg.track) + seg.closed - self.n_prefill for seg in self.segments), default=0)

    def text_limit(self) -> int:
        """Frames the request may have launched before it must wait for text (UNLIMITED once closed)."""
        seg = self.current
        if seg is None or seg.closed:
            return UNLIMITED
        return self.frame_base + len(seg.track) - self.n_prefill
