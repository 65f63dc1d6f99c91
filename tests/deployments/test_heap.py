"""The replica heap's settling after warm-up and the long-collection watch (deployments/heap.py)."""

from __future__ import annotations

import gc

import pytest

from deployments.heap import CollectionWatch, settle_after_warm_up, watch_collections


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # later tests' objects stay collectable as in any process


class _Cycle:
    finalized: list[str] = []

    def __init__(self, name: str) -> None:
        self.name, self.me = name, self

    def __del__(self) -> None:
        _Cycle.finalized.append(self.name)


def test_settling_finalizes_the_warm_ups_garbage_and_freezes_the_survivors(unfrozen):
    _Cycle("warm-up garbage")  # unreachable at once, but only a collection frees a cycle
    kept = _Cycle("kept")
    lines: list[str] = []
    settle_after_warm_up(lines.append)
    assert "warm-up garbage" in _Cycle.finalized and "kept" not in _Cycle.finalized
    assert gc.get_freeze_count() > 0
    assert kept.name == "kept" and len(lines) == 1 and "frozen" in lines[0]
    # a frozen object is never collected again: a later full collection walks none of them
    before = gc.get_freeze_count()
    gc.collect()
    assert gc.get_freeze_count() == before


def test_the_watch_logs_and_counts_only_collections_over_its_threshold():
    now = [0.0]
    lines: list[str] = []
    watch = CollectionWatch(lines.append, threshold_s=0.05, clock=lambda: now[0])
    for spent in (0.01, 0.2, 0.049):
        watch("start", {"generation": 2})
        now[0] += spent
        watch("stop", {"generation": 2, "collected": 7})
    assert watch.long_collections == 1 and len(lines) == 1
    assert "generation-2" in lines[0] and "200 ms" in lines[0] and "7 objects" in lines[0]
    assert watch.longest_s == pytest.approx(0.2)
    watch("stop", {"generation": 0, "collected": 0})  # a stop without its start (installed mid-collection)
    assert watch.long_collections == 1


def test_one_watch_per_process_and_it_sees_real_collections():
    earlier = [c for c in gc.callbacks if isinstance(c, CollectionWatch)]  # servers built by earlier tests
    for c in earlier:
        gc.callbacks.remove(c)
    lines: list[str] = []
    watch = watch_collections(lines.append, threshold_s=0.0)
    try:
        assert watch_collections(lines.append) is watch
        gc.collect()
        assert watch.long_collections >= 1 and "garbage collection held the interpreter" in lines[0]
    finally:
        watch.remove()
        gc.callbacks.extend(earlier)
    assert watch not in gc.callbacks
