"""The texts requests speak: `sentences.txt` beside this file (short English and Chinese sentences), or any
file in the same format (`<language code>\\t<text>` per line, `#` comments)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_FILE = Path(__file__).with_name("sentences.txt")
Language = Literal["en", "zh", "mix"]


@dataclass(frozen=True)
class Sentence:
    language: str
    text: str


def load_sentences(path: str | Path | None = None, language: Language = "mix") -> list[Sentence]:
    out = []
    for n, line in enumerate(Path(path or DEFAULT_FILE).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        code, sep, text = line.partition("\t")
        if not sep or not text.strip():
            raise ValueError(f"{path or DEFAULT_FILE}:{n}: expected '<language>\\t<text>'")
        if language in ("mix", code):
            out.append(Sentence(code, text.strip()))
    if not out:
        raise ValueError(f"no {language!r} sentences in {path or DEFAULT_FILE}")
    return out


class TextPool:
    """Draws sentences in a shuffled order, reshuffling when the pool is used up (few repeats)."""

    def __init__(self, sentences: list[Sentence]):
        self.sentences = list(sentences)
        self._order: list[Sentence] = []

    def draw(self, rng: random.Random, n: int) -> list[Sentence]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = self.sentences[:]
                rng.shuffle(self._order)
            out.append(self._order.pop())
        return out
