"""Splitting a long text into pieces that each fit one Talker request (plain Python, no model).

A text is cut, in this order of preference, at paragraph breaks (a blank line), sentence ends (`. ! ? …` followed
by a space, or CJK `。！？` anywhere), line breaks, clause marks (`, ; :` followed by a space, CJK `；，、：`), and
spaces between words. CJK ideographs, kana and Hangul syllables may also be cut between two characters (no
spaces there); a Latin word is never cut unless it alone exceeds a piece (a run of letters with no space longer
than a whole piece, which is no word), and then only between characters.

What a piece may hold is the caller's: `cost(text)` returns a tuple of fractions of a budget that add up over
concatenated text (per character), and a piece fits when every sum stays <= 1. Pieces are packed greedily, but a
piece that must end is cut at its strongest boundary in its second half (a paragraph over a sentence over a
clause), so pieces end where a reader would pause.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Cost = tuple[float, ...]


class Boundary(enum.IntEnum):
    """What follows a piece (or a unit of text): how strong a pause the text implies there."""

    NONE = 0  # inside a run of characters with no space (only when one word alone exceeds a piece)
    WORD = 1
    CLAUSE = 2
    SENTENCE = 3
    PARAGRAPH = 4  # also the end of the text


@dataclass(frozen=True)
class TextPiece:
    text: str
    boundary: Boundary  # what ends it


_PARAGRAPHS = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
_CLOSERS = "\"'”’)\\]»」』）"
# each pattern matches what ends a part (its mark and the spaces after it): the text is cut after the match
_SENTENCE_ENDS = re.compile(rf"[.!?…]+[{_CLOSERS}]*\s+|[。！？]+[{_CLOSERS}]*\s*|\n\s*")
_CLAUSE_ENDS = re.compile(r"[,;:—]\s+|[，、；：]\s*")
_WORD_ENDS = re.compile(r"\s+")
# scripts written without spaces: a cut after one of their characters is between words (or syllables)
_UNSPACED_ENDS = re.compile(rf"[{_CJK}]\s*")
_LEVELS = ((Boundary.SENTENCE, _SENTENCE_ENDS), (Boundary.CLAUSE, _CLAUSE_ENDS), (Boundary.WORD, _WORD_ENDS),
           (Boundary.WORD, _UNSPACED_ENDS))
# every boundary, strongest first, each pattern matching what ends a part (the live WebSocket finds them as its text
# arrives: deployments/ingress/live_pieces.py)
BOUNDARIES: tuple[tuple[Boundary, re.Pattern], ...] = ((Boundary.PARAGRAPH, _PARAGRAPHS), *_LEVELS)


def split_text(text: str, cost: Callable[[str], Cost]) -> list[TextPiece]:
    """`text` in pieces whose `cost` sums stay <= 1, in order; their texts joined (with a space between Latin
    pieces) read as `text` with its runs of whitespace made single spaces."""
    units: list[tuple[str, Boundary, Cost]] = []
    for paragraph in _PARAGRAPHS.split(text):
        if paragraph.strip():
            _units(paragraph.strip() + " ", Boundary.PARAGRAPH, cost, units)
    return _pack(units)


def _units(text: str, end: Boundary, cost: Callable[[str], Cost], out: list) -> None:
    """`text` as units that each fit alone (cut at ever weaker boundaries until they do); the last one gets `end`."""
    c = cost(text)
    if _fits(c):
        out.append((text, end, c))
        return
    level, parts = _split_below(text, end)
    for i, part in enumerate(parts):
        after = end if i == len(parts) - 1 else level
        if level is Boundary.NONE:
            out.append((part, after, cost(part)))
        else:
            _units(part, after, cost, out)


def _split_below(text: str, end: Boundary) -> tuple[Boundary, list[str]]:
    """`text` cut at the strongest boundary weaker than `end` that cuts it into several parts; as a last resort
    between characters (a run with no space that alone exceeds a piece)."""
    for level, pattern in _LEVELS:
        if level < end or (level is Boundary.WORD and end is Boundary.WORD and pattern is _UNSPACED_ENDS):
            parts = _cut(text, pattern)
            if len(parts) > 1:
                return level, parts
    return Boundary.NONE, list(text)


def _cut(text: str, ends: re.Pattern) -> list[str]:
    parts, start = [], 0
    for m in ends.finditer(text):
        if m.end() > start and text[start:m.end()].strip():
            parts.append(text[start:m.end()])
            start = m.end()
    if text[start:].strip():
        parts.append(text[start:])
    elif parts:
        parts[-1] += text[start:]
    return parts


def _fits(c: Sequence[float]) -> bool:
    return all(x <= 1.0 + 1e-9 for x in c)


def _add(a: Cost, b: Cost) -> Cost:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _pack(units: list[tuple[str, Boundary, Cost]]) -> list[TextPiece]:
    """Greedy: units join the current piece while it fits; a full piece is cut at its strongest boundary in its
    second half (by characters), the units after the cut start the next piece."""
    pieces: list[TextPiece] = []
    current: list[tuple[str, Boundary, Cost]] = []
    total: Cost = ()
    for unit in units:
        while current and not _fits(_add(total, unit[2])):
            keep = _best_cut(current)
            pieces.append(_piece(current[:keep]))
            current = current[keep:]
            total = _sum(current, unit[2])
        current.append(unit)
        total = _add(total, unit[2]) if len(current) > 1 else unit[2]
    if current:
        pieces.append(_piece(current))
    return pieces


def _sum(units: list[tuple[str, Boundary, Cost]], like: Cost) -> Cost:
    total = tuple(0.0 for _ in like)
    for u in units:
        total = _add(total, u[2])
    return total


def _best_cut(units: list[tuple[str, Boundary, Cost]]) -> int:
    """How many units the piece keeps: up to the strongest boundary past its middle (the last one of that
    strength), so the carried-over rest stays shorter than what was kept."""
    chars = sum(len(u[0]) for u in units)
    best, best_level, seen = len(units), units[-1][1], 0
    for i, (text, boundary, _) in enumerate(units):
        seen += len(text)
        if seen * 2 >= chars and boundary > best_level:
            best, best_level = i + 1, boundary
    return best


def _piece(units: list[tuple[str, Boundary, Cost]]) -> TextPiece:
    return TextPiece(re.sub(r"\s+", " ", "".join(u[0] for u in units)).strip(), units[-1][1])
