"""GcPauses counts the collections that ran, by generation, and freeze_heap leaves later full collections only
what was allocated after it."""

import gc

from deployments.gc_pauses import GcPauses


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_collections_are_counted_by_generation():
    pauses = GcPauses()
    try:
        gc.collect(0)
        gc.collect(2)
        s = pauses.stats
        assert s.collections[0] >= 1 and s.collections[2] >= 1
        assert s.seconds[2] > 0.0
    finally:
        pauses.close()
    before = list(pauses.stats.collections)
    gc.collect()
    assert pauses.stats.collections == before  # closed: no longer hooked


def test_freeze_heap_moves_the_live_heap_out_of_later_collections():
    pauses = GcPauses()
    kept = [Node() for _ in range(1000)]
    try:
        frozen = pauses.freeze_heap()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        assert all(gc.is_tracked(n) for n in kept[:3])
        garbage = [Node() for _ in range(100)]
        del garbage
        assert gc.collect() >= 100  # what came after the freeze is still collected
    finally:
        gc.unfreeze()
        pauses.close()
