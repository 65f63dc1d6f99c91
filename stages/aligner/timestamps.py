"""From the timestamp head's classes to word times, as the official `parse_timestamp` does it.

Each word has two `<timestamp>` slots (start, end). The predicted times need not rise monotonically; the official
repair keeps the longest non-decreasing subsequence and rewrites the others: a run of at most two outliers takes the
nearer kept neighbour's value, a longer run is interpolated linearly between its kept neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Word:
    word: str
    start: float  # seconds from the start of the aligned audio, rounded to ms
    end: float


def _longest_non_decreasing(data: list[float]) -> list[bool]:
    """Membership in the official O(n^2) longest non-decreasing subsequence (first maximum, earliest parents)."""
    n = len(data)
    length, parent = [1] * n, [-1] * n
    for i in range(1, n):
        for j in range(i):
            if data[j] <= data[i] and length[j] + 1 > length[i]:
                length[i], parent[i] = length[j] + 1, j
    kept = [False] * n
    idx = length.index(max(length))
    while idx != -1:
        kept[idx] = True
        idx = parent[idx]
    return kept


def repair_monotonic(data: list[float]) -> list[int]:
    """The official `fix_timestamp` (values in ms; the result truncated to int as the official code does)."""
    n = len(data)
    if n == 0:
        return []
    kept = _longest_non_decreasing(data)
    result = list(data)
    i = 0
    while i < n:
        if kept[i]:
            i += 1
            continue
        j = i
        while j < n and not kept[j]:
            j += 1
        left = next((result[k] for k in range(i - 1, -1, -1) if kept[k]), None)
        right = next((result[k] for k in range(j, n) if kept[k]), None)
        if j - i <= 2:
            for k in range(i, j):
                if left is None:
                    result[k] = right
                elif right is None:
                    result[k] = left
                else:
                    result[k] = left if (k - (i - 1)) <= (j - k) else right
        elif left is not None and right is not None:
            step = (right - left) / (j - i + 1)
            for k in range(i, j):
                result[k] = left + step * (k - i + 1)
        elif left is not None or right is not None:
            for k in range(i, j):
                result[k] = left if left is not None else right
        i = j
    return [int(v) for v in result]


def words_from_classes(words: list[str], classes: list[int], segment_ms: float) -> list[Word]:
    """The head's argmax class at each `<timestamp>` slot (2 per word, in order) -> the words with their times."""
    # float32 products, as the official `class_tensor * segment_time` on a torch tensor
    ms = repair_monotonic((np.asarray(classes, dtype=np.float32) * np.float32(segment_ms)).tolist())
    return [Word(w, round(ms[2 * i] / 1000.0, 3), round(ms[2 * i + 1] / 1000.0, 3)) for i, w in enumerate(words)]
