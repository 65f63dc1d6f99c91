"""GcPauses counts the collections that ran, by generation, and reports the frozen heap as it is."""

import gc

from deployments.gc_pauses import GcPauses


class Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_collections_are_counted_by_generation():
    pauses = GcPauses()
    try:
        before = pauses.stats()
        gc.collect(0)
        gc.collect(2)
        after = pauses.stats()
        assert after.collections[0] >= before.collections[0] + 1
        assert after.collections[2] == before.collections[2] + 1 and after.seconds[2] > before.seconds[2]
        assert before.collections[2] == 0  # a copy: later collections do not change it
    finally:
        pauses.close()
    closed = pauses.stats().collections
    gc.collect()
    assert pauses.stats().collections == closed  # closed: no longer hooked


def test_frozen_objects_are_reported_and_skipped_by_collections():
    pauses = GcPauses()
    kept = [Node() for _ in range(1000)]
    try:
        gc.collect()
        gc.freeze()  # as Ray Serve does once a replica's __init__ returned
        assert pauses.stats().frozen == gc.get_freeze_count() >= len(kept)
        garbage = [Node() for _ in range(100)]
        del garbage
        assert gc.collect() >= 100  # what came after the freeze is still collected
    finally:
        gc.unfreeze()
        pauses.close()
    assert pauses.stats().frozen == 0
