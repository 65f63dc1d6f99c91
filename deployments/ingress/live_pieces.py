"""A WebSocket context's text spoken as consecutive Talker live requests ("pieces"), as one stream of audio.

One live request holds at most what fits the model's `max_seq_len` (all its utterances together) and
`max_text_rows` text positions per utterance. A context may carry up to `ingress.max_input_chars`, so it rolls
over: its text goes to the current piece (through the TextMailbox) until the piece is full, then the piece's text
ends (`end`, as a `flush` would end an utterance) at a boundary and a new live request takes what follows.

Sizing is `long_text`'s, from the piece's own request: its text's speech, estimated as slow
(`long_text.estimated_frames`) over `ingress.long_form.piece_fill`, within the request's frame cap, and its current
utterance within the text positions. Below half of that, text is forwarded as it arrives (no latency added). From
half on, text is forwarded up to its last settled boundary (`text_split.BOUNDARIES`; settled: followed by text, or
ended by `flush`/`end`), so the piece can end exactly there: at the first sentence or paragraph end past half, a
clause past `_CLAUSE_FILL`, a word (or, for a run of letters longer than a piece, a character) when the next unit
would not fit, or at a client's `flush` past half. Boundaries are found the same way whatever the text's arrival,
so a seeded context repeats.

Each piece is a live request with the context's voice prompt, instructions and sampling, piece k's seed
`long_text.piece_seed(seed, k)`, and a frame cap of what fits `max_seq_len` (or the client's `max_new_tokens`,
which bounds the context's frames in total: the audio stops there, finish `length`). A piece is started (opened
and admitted to the Talker; a live request waiting for text takes no slot) when the one before it rolls over, so
its first audio is ready before the one before has played out; at most two run at once (text for a third waits
here). Between pieces the audio has the pause the boundary implies (`long_text.pause_after`; none at a `flush`:
the model ends the utterance itself). A piece that stops at a frame cap that is not the client's was cut: `on_cut`
is told, and the context's finish is `length`. Closing the chunks (cancel, disconnect, failure) aborts every piece
that runs. `on_piece` gets each finished piece (`FinishedPiece`: its text, audio and offset in the context's audio).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from deployments.config import LongFormSettings
from deployments.first_audio_timing import FirstAudioTiming
from deployments.ingress.long_form import silence
from deployments.ingress.long_text import FRAMES_PER_CHAR, estimated_frames, pause_after, piece_seed
from deployments.ingress.request_builder import VoiceChoice
from deployments.ingress.schemas import LiveOpen
from deployments.ingress.text_split import BOUNDARIES, Boundary, TextPiece
from deployments.messages import Admitted, DecodedChunk, ModelInfo
from deployments.text_mailbox import TextEvent
from stages.contract import SAMPLES_PER_FRAME, FinishReason

_HALF = 0.5  # a piece filled this far ends at its next sentence or paragraph end (or flush)
_CLAUSE_FILL = 0.8  # ... or clause end
_CONTEXT_CHARS = 8  # text before a unit that its boundary's match may start in (". " after a forwarded ".")
MAX_RUNNING = 2  # pieces of a context running at once: the one being sent and the one started ahead


@dataclass(frozen=True)
class StartedPiece:
    """A piece's live request, started: its decoded chunks (the first item `Admitted`), the frames its estimated
    speech may fill (the request's frame cap had the client set none), and whether its cap is the client's."""

    chunks: AsyncIterator[DecodedChunk | Admitted]
    frame_budget: int
    client_capped: bool


class PieceIO(Protocol):
    """What the pieces need of the ingress (deployments/ingress/live.py)."""

    async def start(self, index: int, request_id: str) -> StartedPiece:
        """Open `request_id`'s mailbox box and start its live request (piece `index`'s seed and cap)."""

    async def put(self, request_id: str, events: list[TextEvent]) -> None: ...

    def close(self, request_id: str) -> None:
        """Close its mailbox box (its Talker request ends if it has not)."""


class MailboxPieces:
    """A context's pieces' Talker live requests (`PieceIO`): each with the
    context's voice (one prompt for all), sampling and instructions, piece k's seed derived from the context's."""

    def __init__(self, ingress, mailbox, body: LiveOpen, info: ModelInfo, choice: VoiceChoice, voice,
                 timing: FirstAudioTiming | None = None):
        """`ingress`: its `start_live` (deployments/ingress/server.py); `mailbox`: the replica's `MailboxWriter`;
        `timing`: the context's first audio's stamps (its first piece's, which speaks first)."""
        self._ingress, self._mailbox = ingress, mailbox
        self._body, self._info, self._choice, self._voice = body, info, choice, voice
        self._timing = timing

    async def start(self, index: int, request_id: str) -> StartedPiece:
        body, info = self._body, self._info
        try:  # the request's mailbox box is made by its first text (or the Talker's claim): no call for it here
            _, fits, chunks = self._ingress.start_live(
                body.model_copy(update={"seed": piece_seed(body.seed, index)}), info, self._choice, self._voice,
                request_id, body.idle_timeout_s, body.max_new_tokens,
                timing=self._timing if index == 0 else None)
        except BaseException:
            self._mailbox.close(request_id)
            raise
        n = body.max_new_tokens
        capped = body.suppress_eos or (n is not None and n <= fits) or fits >= info.default_max_new_tokens
        return StartedPiece(chunks, fits, capped)

    async def put(self, request_id: str, events) -> None:
        # awaited: a context's events reach the mailbox in order (one batch of puts after another)
        await self._mailbox.put(request_id, events)

    def close(self, request_id: str) -> None:
        self._mailbox.close(request_id)


@dataclass(frozen=True)
class FinishedPiece:
    """One finished piece: what a caller may hook (e.g. word timestamps). `start_sample` is where its audio starts
    in the context's 24 kHz PCM (before `speed`), pauses included; `audio` is its PCM (empty unless asked for)."""

    index: int
    text: str
    start_sample: int
    samples: int
    frames: int
    finish_reason: FinishReason | None
    audio: np.ndarray
    pause_after_s: float


@dataclass(eq=False)
class _Piece:
    index: int
    request_id: str
    text: list[str] = field(default_factory=list)
    speech: float = 0.0  # estimated frames of its text
    utterance_bytes: int = 0  # UTF-8 bytes of its current utterance (since its last flush)
    utterance: list[str] = field(default_factory=list)
    after_flush: bool = False
    boundary: Boundary = Boundary.PARAGRAPH  # what ends its text so far
    rolled: bool = False  # its text ended at a rollover: a next piece follows
    pause_after_s: float = 0.0
    queued: list[TextEvent] = field(default_factory=list)  # events before it started
    started: StartedPiece | None = None
    failure: BaseException | None = None  # starting it failed: the context fails when it is its turn
    first: asyncio.Task | None = None  # its admission (the first item of its chunks)
    closed: bool = False

    async def close(self, io: PieceIO) -> None:
        if self.closed:
            return
        self.closed = True
        if self.started is None:
            return
        if self.first is not None and not self.first.done():
            self.first.cancel()
        with contextlib.suppress(BaseException):  # its outcome no longer matters
            await self.first
        try:
            await self.started.chunks.aclose()  # aborts its Talker request when it has not ended
        finally:
            io.close(self.request_id)


class LivePieces:
    """One context's pieces: `append`/`flush`/`end` from the connection's messages (one at a time), `chunks()` its
    audio (read by one task), `aclose()` when the context ends."""

    def __init__(self, io: PieceIO, request_id: str, tokenizer, max_text_rows: int, settings: LongFormSettings,
                 frame_cap: int | None = None, on_cut: Callable[[int, int], None] | None = None,
                 on_piece: Callable[[FinishedPiece], Awaitable[None] | None] | None = None):
        """`frame_cap`: the client's `max_new_tokens` (the context's frames in total); `on_cut(index, frames)`: a
        piece cut at a cap not the client's; `on_piece`: each finished piece (with its audio)."""
        self._io, self._request_id, self._tokenizer = io, request_id, tokenizer
        self._max_text_rows, self._settings, self._frame_cap = max_text_rows, settings, frame_cap
        self._on_cut, self._on_piece = on_cut, on_piece
        self._pieces: list[_Piece] = [_Piece(0, request_id)]
        self._text = ""  # all text received
        self._sent = 0  # of which forwarded to a piece
        self._budget = 1  # frames a piece's estimated speech may fill (from the first piece's request)
        self._lock = asyncio.Lock()  # piece starts and puts, from the text side and the audio side
        self._closed = False
        self.frames = 0  # codec frames sent (the usage)
        self.samples = 0  # PCM samples sent, pauses included (the duration, before `speed`)
        self.finish_reason: FinishReason | None = None

    @property
    def text(self) -> str:
        return self._text

    @property
    def pieces(self) -> int:
        return len(self._pieces)

    def piece_text(self, request_id: str) -> str:
        """The text a piece was given, by its Talker request id ("" for an unknown one)."""
        return next(("".join(p.text) for p in self._pieces if p.request_id == request_id), "")

    async def open(self) -> None:
        """Start the first piece; raises what refuses it (the context does not open)."""
        first = self._pieces[0]
        started = await self._io.start(0, first.request_id)
        first.started, self._budget = started, max(int(started.frame_budget * self._settings.piece_fill), 1)
        first.first = asyncio.get_running_loop().create_task(anext(started.chunks))

    # ------------------------------------------------------------------ text
    async def append(self, text: str) -> None:
        self._text += text
        await self._forward(final=False)

    async def flush(self) -> None:
        await self._forward(final=True, last=TextEvent("flush"))

    async def end(self) -> None:
        await self._forward(final=True, last=TextEvent("end"))

    async def _forward(self, final: bool, last: TextEvent | None = None) -> None:
        out: dict[_Piece, list[TextEvent]] = {}
        piece = self._pieces[-1]
        rest = self._text[self._sent:]
        if rest and self._fill(piece, rest) < _HALF:
            self._take(piece, rest, out)  # far from full: as it arrives
        else:
            while (unit := self._next_unit(final)) is not None:
                text, boundary = unit
                if piece.text and ((piece.after_flush and self._fill(piece) >= _HALF) or self._fill(piece, text) > 1):
                    pause = 0.0 if piece.after_flush else pause_after(TextPiece("", piece.boundary), self._settings)
                    piece = self._roll(piece, pause, out)
                self._take(piece, text, out)
                piece.boundary = boundary
                fill = self._fill(piece)
                more = self._sent < len(self._text)
                if more and ((boundary >= Boundary.SENTENCE and fill >= _HALF) or
                             (boundary >= Boundary.CLAUSE and fill >= _CLAUSE_FILL)):
                    piece = self._roll(piece, pause_after(TextPiece("", boundary), self._settings), out)
        if last is not None:
            out.setdefault(piece, []).append(last)
            piece.utterance, piece.utterance_bytes = [], 0
            piece.after_flush = bool(piece.text)
        async with self._lock:
            for p, events in out.items():
                await self._put(p, events)
            await self._start_ready()

    def _take(self, piece: _Piece, text: str, out: dict) -> None:
        piece.text.append(text)
        piece.utterance.append(text)
        piece.speech += estimated_frames(text)
        piece.utterance_bytes += len(text.encode("utf-8", "surrogatepass"))
        piece.after_flush = False
        self._sent += len(text)
        out.setdefault(piece, []).append(TextEvent("append", text))

    def _roll(self, piece: _Piece, pause_s: float, out: dict) -> _Piece:
        """End `piece`'s text here; the next piece takes what follows."""
        piece.rolled, piece.pause_after_s = True, pause_s
        out.setdefault(piece, []).append(TextEvent("end"))
        k = len(self._pieces)
        nxt = _Piece(k, f"{self._request_id}.{k}")
        self._pieces.append(nxt)
        return nxt

    def _fill(self, piece: _Piece, extra: str = "") -> float:
        """The share of one piece that `piece` with `extra` takes (the larger of speech and text positions)."""
        speech = (piece.speech + estimated_frames(extra)) / self._budget
        n = piece.utterance_bytes + len(extra.encode("utf-8", "surrogatepass"))
        if n > self._max_text_rows:  # the tokenizer makes at most a token per byte: count them only past there
            n = len(self._tokenizer.encode("".join(piece.utterance) + extra))
        return max(speech, (n + 1) / self._max_text_rows)  # + its end row

    def _next_unit(self, final: bool) -> tuple[str, Boundary] | None:
        """The next unforwarded text up to its first settled boundary, and that boundary's strength; None when there
        is none yet. `final`: the text so far is all there is (flush/end)."""
        text, sent = self._text, self._sent
        if sent >= len(text):
            return None
        # a piece never holds more characters than this (a frame per character at least): no boundary within it
        # means a run longer than a piece, cut between characters
        window = int(self._budget / FRAMES_PER_CHAR) + 1
        start = max(sent - _CONTEXT_CHARS, 0)
        scan = text[start:sent + window + _CONTEXT_CHARS]
        best: tuple[int, Boundary] | None = None
        for level, pattern in BOUNDARIES:
            for m in pattern.finditer(scan, sent - start):
                end = start + m.end()
                if end <= sent:
                    continue
                if end == len(text) and not final:  # it may still grow ("." before its space, "\n" before "\n")
                    break
                if best is None or end < best[0] or (end == best[0] and level > best[1]):
                    best = (end, level)
                break
        if best is not None and best[0] - sent <= window:
            return text[sent:best[0]], best[1]
        if final:
            if len(text) - sent > window:
                return text[sent:sent + window], Boundary.NONE
            return text[sent:], Boundary.PARAGRAPH
        if len(text) - sent > window:
            return text[sent:sent + window], Boundary.NONE
        return None

    async def _put(self, piece: _Piece, events: list[TextEvent]) -> None:
        if piece.started is not None:
            await self._io.put(piece.request_id, events)
        else:
            piece.queued.extend(events)

    async def _start_ready(self) -> None:
        """Start the next piece not started yet while fewer than `MAX_RUNNING` run (under the lock)."""
        while not self._closed:
            running = [p for p in self._pieces if p.started is not None and not p.closed]
            waiting = next((p for p in self._pieces if p.started is None and p.failure is None and not p.closed), None)
            if waiting is None or len(running) >= MAX_RUNNING:
                return
            try:
                waiting.started = await self._io.start(waiting.index, waiting.request_id)
            except Exception as exc:  # its turn in `chunks` raises it
                waiting.failure = exc
                return
            waiting.first = asyncio.get_running_loop().create_task(anext(waiting.started.chunks))
            if self._closed:  # the context ended while it started
                await waiting.close(self._io)
                return
            events, waiting.queued = waiting.queued, []
            if events:
                await self._io.put(waiting.request_id, events)

    # ------------------------------------------------------------------ audio
    async def chunks(self) -> AsyncIterator[DecodedChunk | Admitted]:
        """The first piece's `Admitted` (it raises if the Talker refused it), then every piece's audio in
        order with the pauses between; `frames` and `finish_reason` hold the context's at the end."""
        offset, k = 0, 0
        while k < len(self._pieces):
            piece = self._pieces[k]
            if piece.failure is not None:
                raise piece.failure
            if piece.first is None:
                raise RuntimeError(f"piece {k} of a live context was never started")
            admitted = await piece.first
            if not isinstance(admitted, Admitted):
                raise RuntimeError(f"a live request's first item is {type(admitted).__name__}, not Admitted")
            if k == 0:
                yield admitted
            frames, finish, audio = 0, None, []
            async for chunk in piece.started.chunks:
                if self._frame_cap is not None and self.frames + chunk.codec_frames >= self._frame_cap:
                    keep = self._frame_cap - self.frames
                    chunk = dataclasses.replace(chunk, pcm=chunk.pcm[:keep * SAMPLES_PER_FRAME],
                                                finish_reason=FinishReason.LENGTH)
                frames += chunk.codec_frames
                self.frames += chunk.codec_frames
                self.samples += chunk.pcm.size
                finish = chunk.finish_reason or finish
                if self._on_piece is not None:
                    audio.append(chunk.pcm)
                yield dataclasses.replace(chunk, final=False, finish_reason=None)
                if self._frame_cap is not None and self.frames >= self._frame_cap:
                    break
            capped = self._frame_cap is not None and self.frames >= self._frame_cap
            if finish is FinishReason.LENGTH or capped:
                self.finish_reason = FinishReason.LENGTH
                if finish is FinishReason.LENGTH and not piece.started.client_capped and not capped and self._on_cut:
                    self._on_cut(piece.index, frames)
            elif self.finish_reason is not FinishReason.LENGTH:
                self.finish_reason = finish
            samples = frames * SAMPLES_PER_FRAME
            if self._on_piece is not None:
                pcm = np.concatenate(audio) if audio else np.zeros(0, np.int16)
                reported = self._on_piece(FinishedPiece(piece.index, "".join(piece.text), offset, pcm.size, frames,
                                                        finish, pcm, piece.pause_after_s if piece.rolled else 0.0))
                if reported is not None:
                    await reported
            offset += samples
            async with self._lock:
                await piece.close(self._io)
                await self._start_ready()
            if capped or not piece.rolled:
                return
            if piece.pause_after_s > 0:
                pause = silence(piece.pause_after_s)
                offset += pause.size
                self.samples += pause.size
                yield DecodedChunk(piece.request_id, -1, pause, False, None, pause=True)
            k += 1

    async def aclose(self) -> None:
        """Abort every piece that runs; none starts after."""
        async with self._lock:
            self._closed = True
            pieces = [p for p in self._pieces if not p.closed]
        for piece in pieces:
            await piece.close(self._io)
