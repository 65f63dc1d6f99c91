"""A long input's pieces (deployments/ingress/long_text.py) run one after another as one stream of decoded chunks.

The writers (deployments/ingress/speech.py) read it as they read one request's chunks, so the response is one
body / one encoder / one SSE sequence. Pipelined: while piece k is being sent, piece k+1 already runs (it is started,
i.e. admitted to the Talker, as soon as piece k's first audio is in hand), so the listener hears no gap at a
boundary, only the pause the text implies (a silent chunk between the pieces). At most two pieces of a request run
at a time; the next one's audio waits in its pipeline (bounded by one piece).

Finish: the chunks carry no piece's finish reason but the last chunk, which carries the whole input's: `length`
when any piece stopped at its frame cap, else the last piece's. A piece that reached its cap without EOS when the
cap was not the client's (long_text.client_capped) was cut: `on_cut` is told (the ingress counts and logs it).
Closing the iterator (the client left, a deadline, a failure) aborts every piece that runs: the current one and
the one started ahead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import numpy as np

from deployments.ingress.long_text import PlannedPiece
from deployments.messages import DecodedChunk
from stages.contract import SAMPLE_RATE, FinishReason

StartPiece = Callable[[PlannedPiece], AsyncIterator[DecodedChunk]]


class _Running:
    """One started piece: its decoded-chunk pipeline and the task awaiting its first chunk (which starts it)."""

    def __init__(self, piece: PlannedPiece, start: StartPiece):
        self.piece = piece
        self.chunks = start(piece)
        self.first = asyncio.get_running_loop().create_task(anext(self.chunks, None))

    async def close(self) -> None:
        if not self.first.done():
            self.first.cancel()
        with contextlib.suppress(BaseException):  # its outcome no longer matters: the response ends
            await self.first
        await self.chunks.aclose()


async def long_form_chunks(pieces: list[PlannedPiece], start: StartPiece, piece_timeout_s: float,
                           on_cut: Callable[[PlannedPiece, int], None]) -> AsyncIterator[DecodedChunk]:
    """The decoded chunks of `pieces`, in order, with a silent chunk of each piece's `pause_s` after it.

    `start(piece)` makes a piece's pipeline (nothing runs until its first chunk is awaited). Each piece must
    finish within `piece_timeout_s` of becoming the one being sent (TimeoutError otherwise). `on_cut(piece,
    frames)` is called for a piece cut at its frame cap (see the module's docstring).
    """
    current: _Running | None = None
    ahead: _Running | None = None
    finish = None
    try:
        current = _Running(pieces[0], start)
        for k, piece in enumerate(pieces):
            deadline = asyncio.get_running_loop().time() + piece_timeout_s
            async with asyncio.timeout_at(deadline):
                chunk = await current.first
            if k + 1 < len(pieces):  # admitted now: its first audio is ready long before this piece has played
                ahead = _Running(pieces[k + 1], start)
            frames, piece_finish = 0, None
            while chunk is not None:
                frames += chunk.codec_frames
                piece_finish = chunk.finish_reason or piece_finish
                if piece_finish is FinishReason.LENGTH:
                    finish = FinishReason.LENGTH
                last = k == len(pieces) - 1 and chunk.final
                yield dataclasses.replace(chunk, final=last, finish_reason=(finish or piece_finish) if last else None)
                async with asyncio.timeout_at(deadline):
                    chunk = await anext(current.chunks, None)
            if piece_finish is FinishReason.LENGTH and not piece.client_capped:
                on_cut(piece, frames)
            if piece.pause_s > 0:
                yield DecodedChunk(piece.request.request_id, -1, silence(piece.pause_s), False, None, pause=True)
            await current.close()
            current, ahead = ahead, None
    finally:
        for running in (current, ahead):
            if running is not None:
                await running.close()


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * SAMPLE_RATE), dtype=np.int16)
