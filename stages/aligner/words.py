"""The official aligner's text side (`Qwen3ForceAlignProcessor`): which words of a text get timestamps.

A text is split on whitespace; every piece keeps only letters, digits and apostrophes (Unicode categories L* and N*,
so punctuation and symbols vanish); CJK ideographs then become words of one character each. The official package
segments Japanese with nagisa and Korean with soynlp, two models this project does not ship: those two languages are
refused with a ValueError rather than segmented differently from the official aligner.
"""

from __future__ import annotations

import unicodedata

# the languages of the released checkpoint (its config.json `support_languages`)
SUPPORTED_LANGUAGES = ("Chinese", "English", "Cantonese", "French", "German", "Italian", "Japanese", "Korean",
                       "Portuguese", "Russian", "Spanish")
UNSEGMENTED_LANGUAGES = ("japanese", "korean")
# what `split_words` takes a language hint for: the supported ones it does not refuse
ALIGNABLE_LANGUAGES = tuple(lang for lang in SUPPORTED_LANGUAGES if lang.lower() not in UNSEGMENTED_LANGUAGES)
NO_LANGUAGE = ("", "auto")  # no hint


def alignable_language(name: str | None) -> str:
    """`split_words`' hint for a request's language: "" for none (None, "", "auto"), else its canonical name; a
    ValueError saying why for a language the aligner does not time."""
    name = (name or "").strip()
    if name.lower() in NO_LANGUAGE:
        return ""
    for known in ALIGNABLE_LANGUAGES:
        if known.lower() == name.lower():
            return known
    if name.lower() in UNSEGMENTED_LANGUAGES:
        raise ValueError(f"word timestamps for {name} are not supported: the aligner segments it with a statistical "
                         "word segmenter this server does not ship")
    raise ValueError(f"word timestamps are not available for language {name[:64]!r}; they are for "
                     f"{', '.join(ALIGNABLE_LANGUAGES)}")


def is_kept_char(ch: str) -> bool:
    if ch == "'":
        return True
    category = unicodedata.category(ch)
    return category.startswith("L") or category.startswith("N")


def clean_token(token: str) -> str:
    return "".join(ch for ch in token if is_kept_char(ch))


def is_cjk_char(ch: str) -> bool:
    code = ord(ch)
    return (
        0x4E00 <= code <= 0x9FFF  # CJK Unified Ideographs
        or 0x3400 <= code <= 0x4DBF  # Extension A
        or 0x20000 <= code <= 0x2A6DF  # Extension B
        or 0x2A700 <= code <= 0x2B73F  # Extension C
        or 0x2B740 <= code <= 0x2B81F  # Extension D
        or 0x2B820 <= code <= 0x2CEAF  # Extension E
        or 0xF900 <= code <= 0xFAFF  # Compatibility Ideographs
    )


def _split_ideographs(segment: str) -> list[str]:
    words: list[str] = []
    run = ""
    for ch in segment:
        if is_cjk_char(ch):
            if run:
                words.append(run)
                run = ""
            words.append(ch)
        else:
            run += ch
    if run:
        words.append(run)
    return words


def split_words(text: str, language: str = "") -> list[str]:
    """The words of `text` the aligner times, in order (the official `tokenize_space_lang`; `language` only matters
    for Japanese and Korean, which are refused)."""
    if language.strip().lower() in UNSEGMENTED_LANGUAGES:
        raise ValueError(f"word timestamps for {language} are not supported: the official aligner segments it with "
                         "a statistical word segmenter this server does not ship")
    words: list[str] = []
    for piece in text.split():
        cleaned = clean_token(piece)
        if cleaned:
            words.extend(_split_ideographs(cleaned))
    return words
