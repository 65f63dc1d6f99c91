"""Word (and character) timestamps of a speech response, from the `Aligner` deployment (docs/aligner.md).

A response's audio is one or more spans, one per Talker request (a long input's pieces, with the silence put between
them). The writer passes every decoded chunk it sends to `ResponseTimestamps.observe`; a span is complete when the
next span's audio (or a pause, or the end) comes, and then its audio and text go to the aligner at once, while
later audio keeps streaming. `ready()` hands back the timestamps of spans that are aligned, in span order, so a
writer sends each span's words after its audio; `rest()` waits for the others (before `done`).

Times are seconds from the start of the whole response, on the played timeline (`speed` applied), rounded to ms,
and inside the audio of their span (the aligner's head can place a word past the audio it was given; such a time
is clamped to the span's end).
`"char"` timestamps are derived from the words: a word's characters share its time evenly, and every other
character of the text (spaces, punctuation) is a point at the end of the word before it (or the start of the next).
A span the aligner could not time (a failure of its replica, an audio it refuses) gets an event with no words and
the error: the audio, already sent, stays whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from deployments.errors import APIError, bad_request, to_api_error
from deployments.messages import AlignRequest, DecodedChunk
from stages.aligner.timestamps import Word
from stages.aligner.words import alignable_language, is_kept_char
from stages.contract import SAMPLE_RATE

logger = logging.getLogger("ray.serve")

TimestampMode = Literal["word", "char"]
Align = Callable[[AlignRequest], Awaitable[list[Word]]]


def no_aligner() -> APIError:
    return bad_request("this server has no aligner: `timestamps` needs one (the `aligner` section of the serve config; "
                       "docs/aligner.md)", "timestamps", code="timestamps_unavailable")


def check_language(language: str | None) -> None:
    """A 400 naming `timestamps` for a language the aligner does not time, before anything runs (the Aligner's own
    check, stages.aligner.words.alignable_language, asked here so that no audio is made for nothing)."""
    try:
        alignable_language(language)
    except ValueError as exc:
        raise bad_request(str(exc), "timestamps", code="unsupported_language") from None


def char_times(text: str, words: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every character of `text` with a time, from its words' times (see the module's docstring). The aligner's
    words are `text`'s letters, digits and apostrophes in order (stages/aligner/words.py), so each such character
    belongs to the next word still being spelt; a character past the last word is a point at the last word's end."""
    out: list[dict[str, Any]] = []
    index, spelt, at = 0, 0, words[0]["start"] if words else 0.0
    for ch in text:
        if index < len(words) and not ch.isspace() and is_kept_char(ch):
            word = words[index]
            n = max(len(word["word"]), 1)
            step = (word["end"] - word["start"]) / n
            start = word["start"] + spelt * step
            out.append({"char": ch, "start": round(start, 3), "end": round(start + step, 3)})
            spelt += 1
            if spelt >= len(word["word"]):
                index, spelt, at = index + 1, 0, word["end"]
        else:
            out.append({"char": ch, "start": at, "end": at})
    return out


@dataclass
class _Span:
    """One Talker request's audio within the response."""

    request_id: str
    text: str
    offset: int  # samples of the response before it (24 kHz, before `speed`)
    pcm: list[np.ndarray] = field(default_factory=list)
    seconds: float = 0.0  # its audio's, once complete
    task: asyncio.Task | None = None


class ResponseTimestamps:
    """The timestamps of one response (see the module's docstring). `texts`: each Talker request's text by its
    request id (the chunks' `request_id`), or a function of the request id, asked once its span is complete (a live
    context's piece has all its text by then)."""

    def __init__(self, align: Align, texts: dict[str, str] | Callable[[str], str], mode: TimestampMode,
                 language: str | None, speed: float = 1.0):
        self._align, self.mode, self._speed = align, mode, speed
        self._text_of = texts.get if isinstance(texts, dict) else texts
        self._language = None if language in (None, "auto") else language
        self._samples = 0  # of the response so far
        self._current: _Span | None = None
        self._pending: list[_Span] = []  # sent to the aligner, not yet handed back (in span order)

    def observe(self, chunk: DecodedChunk) -> None:
        if chunk.pause or (self._current is not None and chunk.request_id != self._current.request_id):
            self._close_span()
        if not chunk.pause and chunk.pcm.size:
            if self._current is None:
                self._current = _Span(chunk.request_id, "", self._samples)
            self._current.pcm.append(chunk.pcm)
        self._samples += chunk.pcm.size

    def end(self) -> None:
        """The response's audio is complete: its last span goes to the aligner."""
        self._close_span()

    def ready(self) -> list[dict[str, Any]]:
        """The events of the spans aligned so far that no earlier span is still waiting on, in order."""
        events = []
        while self._pending and self._pending[0].task.done():
            events.append(self._event(self._pending.pop(0)))
        return events

    async def rest(self) -> list[dict[str, Any]]:
        """Every remaining span's event, in order (waits for the aligner)."""
        if self._pending:
            await asyncio.wait([s.task for s in self._pending])
        return self.ready()

    async def aclose(self) -> None:
        """The response ended early: alignments nobody will read are cancelled."""
        for span in self._pending:
            span.task.cancel()
        for span in self._pending:
            with contextlib.suppress(BaseException):
                await span.task
        self._pending.clear()

    def _close_span(self) -> None:
        span, self._current = self._current, None
        if span is None:
            return
        pcm = np.concatenate(span.pcm)
        span.pcm, span.seconds = [pcm], pcm.size / SAMPLE_RATE
        span.text = self._text_of(span.request_id) or ""
        request = AlignRequest(span.request_id, pcm, span.text, self._language)
        span.task = asyncio.get_running_loop().create_task(self._aligned(request))
        self._pending.append(span)

    async def _aligned(self, request: AlignRequest) -> list[Word]:
        if not request.text.strip():
            return []
        return await self._align(request)

    def _event(self, span: _Span) -> dict[str, Any]:
        start_s = span.offset / SAMPLE_RATE
        span.pcm = []  # its audio is no longer needed
        try:
            words = span.task.result()
        except Exception as exc:
            error = to_api_error(exc)
            logger.warning(f"timestamps of {span.request_id} failed: {error.message}")
            return {"words": [], **({"chars": []} if self.mode == "char" else {}), "error": error.body()["error"]}
        def at(t: float) -> float:  # inside the span's audio, whatever the aligner's head says
            return round((start_s + min(max(t, 0.0), span.seconds)) / self._speed, 3)

        timed = [{"word": w.word, "start": at(w.start), "end": at(w.end)} for w in words]
        event: dict[str, Any] = {"words": timed}
        if self.mode == "char":
            event["chars"] = char_times(span.text, timed)
        return event
