"""Text that arrives in pieces (an LLM writing), tokenized exactly as the whole text would be.

A BPE tokenizer is not prefix-stable: "assis" + "tant" is one token once both halves are there, and a
trailing space joins the next word (" world"). `TextStream` re-tokenizes the text it has not released yet
and releases only ids that no later text can change:

- the Qwen2 pre-tokenizer (a regex) cuts text into words, and BPE merges never cross a word, so every word
  but the last is final; the last one is held back until the next word starts, or until `flush`/`end`;
- the text is NFC-normalized before it is cut, so a cut must also sit before a character that cannot
  compose with or reorder behind what precedes it (a combining mark, a Hangul vowel/final jamo can);
- special tokens ("<|im_end|>") are matched in the raw text first, so a tail that could still grow into one
  is held back as well;
- nothing is released while the text is blank, so a blank segment can be dropped whole.

Once a cut is released, the rest is tokenized from the cut: a word boundary is a fresh start for the regex
(it has no look-behind), so the ids equal those of the whole text (tests/stages/test_text_stream.py checks
many splits, char by char and unicode). The first word is tokenized inside the target template, as
`TextTokenizer.target_ids` does, since the template's newline and a leading newline of the text are one word.

`flush` closes a segment: its held-back tail is released and the next text starts a new segment, tokenized
on its own (the engine speaks each segment as a whole utterance: docs/talker_engine.md, "Live text").
"""

from __future__ import annotations

import functools
import unicodedata
from dataclasses import dataclass

from stages.prompts import TextTokenizer

_ROLE_PREFIX = "<|im_start|>assistant\n"  # the target template up to the text (3 ids: the role)
_ROLE_IDS = 3
_MAX_CUTS_TRIED = 4  # word starts tried per call, from the last (each costs two tokenizer calls)


@dataclass(frozen=True)
class TextPiece:
    """Ids of one segment that no later text can change, following those of its earlier pieces."""

    segment: int  # 0, 1, ...: a flush closes segment k, later text goes to k + 1
    ids: tuple[int, ...]
    role_ids: tuple[int, ...] | None = None  # with a segment's first ids: its role ids (target template)
    closed: bool = False  # the segment's text is complete (flush or end)
    ended: bool = False  # end: no segment follows


class TextStream:
    """One request's text, piece by piece -> `TextPiece`s. Not thread-safe (one caller)."""

    def __init__(self, tokenizer: TextTokenizer):
        self._tok = tokenizer
        self._special_prefixes, self._special_max = _special_prefixes(tokenizer)
        self.segment = 0
        self._tail = ""  # text of this segment not released yet (starts at a safe cut)
        self._fresh = True  # nothing of this segment released yet: tokenize inside the template
        self.ended = False

    @property
    def pending_text(self) -> str:
        """Text held back (not released as ids yet)."""
        return self._tail

    def append(self, text: str) -> TextPiece | None:
        """Add text; returns the ids it made final (None: nothing new)."""
        self._check_open()
        self._tail += text
        if not self._tail.strip():
            return None
        ids, role, cut = self._stable()
        if cut == 0:
            return None
        self._tail = self._tail[cut:]
        return self._piece(ids, role)

    def flush(self) -> TextPiece | None:
        """Release the held-back tail and close the segment (None: the segment had no text at all)."""
        self._check_open()
        if self._fresh and not self._tail.strip():
            self._tail = ""
            return None
        piece = self._close(ended=False)
        self.segment += 1
        return piece

    def end(self) -> TextPiece:
        """The text is complete: the last segment closes (with no ids when it had no text)."""
        self._check_open()
        self.ended = True
        if self._fresh and not self._tail.strip():
            return TextPiece(self.segment, (), closed=True, ended=True)
        return self._close(ended=True)

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        if self.ended:
            raise RuntimeError("text already ended")

    def _piece(self, ids: list[int], role: tuple[int, ...] | None, closed: bool = False,
               ended: bool = False) -> TextPiece:
        piece = TextPiece(self.segment, tuple(ids), role if self._fresh else None, closed, ended)
        self._fresh = False
        return piece

    def _close(self, ended: bool) -> TextPiece:
        if self._fresh:
            role, ids = self._tok.target_ids(self._tail)
            ids = list(ids)
        else:
            role, ids = None, self._tok.encode(self._tail)
        piece = self._piece(ids, role, closed=True, ended=ended)
        self._tail, self._fresh = "", True
        return piece

    def _stable(self) -> tuple[list[int], tuple[int, ...] | None, int]:
        """-> (ids before the last safe cut, role ids, the cut's offset in the tail); cut 0: none yet."""
        prefix = _ROLE_PREFIX if self._fresh else ""
        ids, words, offsets = self._tok.encode_words(prefix + self._tail)
        first = _ROLE_IDS if self._fresh else 0
        role = tuple(ids[:_ROLE_IDS]) if self._fresh else None
        limit = self._special_prefix_start()
        # tokens that begin a word inside the tail, last first: the first safe cut wins
        starts = [i for i in range(first + 1, len(ids)) if words[i] != words[i - 1]]
        for i in reversed(starts[-_MAX_CUTS_TRIED:]):  # none of these: hold all for now (never wrong, only later)
            # a word starts where its first token starts, or (offsets trimmed of spaces) where the previous ends
            for cut in sorted({offsets[i][0] - len(prefix), offsets[i - 1][1] - len(prefix)}, reverse=True):
                if 0 < cut <= limit and _nfc_boundary_before(self._tail[cut]) and self._splits_at(ids, i, cut):
                    return list(ids[first:i]), role, cut
        return [], role, 0

    def _splits_at(self, ids: list[int], i: int, cut: int) -> bool:
        """Tokenizing the tail's two sides apart gives ids[:i] and ids[i:] (offsets are trusted no further)."""
        prefix = _ROLE_PREFIX if self._fresh else ""
        return (self._tok.encode(prefix + self._tail[:cut]) == list(ids[:i])
                and self._tok.encode(self._tail[cut:]) == list(ids[i:]))

    def _special_prefix_start(self) -> int:
        """Where a special token could still be completing at the end of the tail (len(tail): nowhere)."""
        tail = self._tail
        for p in range(max(0, len(tail) - self._special_max + 1), len(tail)):
            if tail[p:] in self._special_prefixes:
                return p
        return len(tail)


@functools.lru_cache(maxsize=8)
def _special_prefixes(tokenizer: TextTokenizer) -> tuple[frozenset[str], int]:
    """Proper prefixes of the tokenizer's special tokens (matched in the raw text), and the longest's length."""
    specials = tokenizer.added_tokens()
    return frozenset(s[:k] for s in specials for k in range(1, len(s))), max((len(s) for s in specials), default=1)


@functools.cache
def _composing_seconds() -> frozenset[str]:
    """Characters that compose with the character before them under NFC (the second of a canonical pair)."""
    out = {chr(c) for c in range(0x1161, 0x1176)} | {chr(c) for c in range(0x11A8, 0x11C3)}  # Hangul V, T jamo
    for cp in range(0x2FA20):  # canonical decompositions end below U+2FA1E
        d = unicodedata.decomposition(chr(cp))
        if d and not d.startswith("<"):
            parts = d.split()
            if len(parts) == 2:
                out.add(chr(int(parts[1], 16)))
    return frozenset(out)


def _nfc_boundary_before(ch: str) -> bool:
    """NFC(a + b) == NFC(a) + NFC(b) for any a when b starts with `ch`: a starter that composes with nothing
    before it (combining marks reorder and compose; some starters, e.g. Hangul jamo, compose backwards)."""
    first = unicodedata.normalize("NFD", ch)[0]
    return unicodedata.combining(first) == 0 and first not in _composing_seconds()
