"""The invariant GEMM tile sweep's pure-Python part (bench/kernels/invariant_matmul.py): its candidates, the check
that the sweep rows cover the row buckets, the choice of `SWEPT` from sweep results (here synthetic, with known
answers; the sweep itself needs CUDA) and the Python it prints for stages/invariant_matmul.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.kernels import invariant_matmul as bench
from stages import invariant_matmul as im

ROWS = [64, 128, 256, 512]  # one per row bucket


def _t(bm, bn, bk, warps, stages, **variant) -> im.Tiles:
    return im.Tiles(bm, bn, bk, 8, warps, stages, **variant)


def _result(families: dict[int, list[im.Tiles] | None], times: dict[im.Tiles, list[float]]) -> dict:
    """A `sweep` result: per split count its members (None: a family with two hashes), each candidate's time per
    row count of ROWS."""
    out = {"families": {}, "times": {}, "configs": {}}
    for split, members in families.items():
        if members is None:
            out["families"][split] = {"ok": False, "hashes": {"a": [], "b": []}}
            continue
        out["families"][split] = {"ok": True, "hashes": {f"h{split}": [bench.label(cfg) for cfg in members]}}
    for cfg, per_row in times.items():
        out["times"][bench.label(cfg)] = dict(zip(ROWS, per_row, strict=True))
        out["configs"][bench.label(cfg)] = dataclasses.asdict(cfg)
    return out


def test_sweep_rows_must_cover_each_row_bucket_once():
    assert bench.bucket_rows([512, 64, 256, 128]) == ROWS
    assert bench.bucket_rows([1, 65, 200, 4000]) == [1, 65, 200, 4000]
    for rows in ([64, 256, 512], [32, 64, 128, 256, 512], [64, 128, 256, 257, 512]):
        with pytest.raises(ValueError, match="one row count per row bucket"):
            bench.bucket_rows(rows)


def test_candidates_cover_each_split_family_and_the_current_table():
    for _, n, k, _ in bench.SHAPES:
        found = bench.candidates(n, k)
        assert len(set(found)) == len(found), (n, k)
        assert {cfg.split_k for cfg in found} == set(bench.splits(n, k)), (n, k)
        assert all(k // cfg.split_k >= bench.SPLIT_MIN_CHUNK or cfg.split_k == 1 for cfg in found), (n, k)
        assert {im.tiles(m, n, k, torch.bfloat16) for m in (1, 100, 200, 4000)} <= set(found), (n, k)
        assert len({bench.label(cfg) for cfg in found}) == len(found), (n, k)  # labels key the results
    assert bench.splits(12288, 2048) == (1,) and bench.splits(4096, 1024) == (1, 2)
    assert bench.splits(2048, 6144) == (1, 2, 4)


def test_split_count_is_chosen_with_the_256_row_bucket_weighted_and_tiles_within_that_family():
    a1, b1 = _t(64, 32, 128, 4, 3), _t(128, 128, 64, 8, 4, tma=True)
    a4, b4 = _t(64, 32, 128, 4, 3, split_k=4), _t(64, 128, 64, 4, 4, split_k=4)
    a2 = _t(64, 64, 128, 4, 3, split_k=2)
    # split 4 is faster at 64, 128 and 512 rows (best per bucket summed: 36 vs split 1's 39) but slower at 256,
    # which counts 3x (74 vs 61); split 2's family gave two sets of bits: out, however fast
    down = _result({1: [a1, b1], 2: None, 4: [a4, b4]},
                   {a1: [6, 8, 12, 16], b1: [7, 9, 11, 14], a4: [5, 6, 19, 12], b4: [6, 7, 20, 6], a2: [1, 1, 1, 1]})
    table = bench.choose({"talker.down": down}, ROWS)
    choice = table[(2048, 6144)]
    assert choice["split"] == 1 and choice["tiles"] == [a1, a1, b1, b1]
    runs = bench.DECODE_RUNS["talker.down"]
    assert choice["cost"] == {1: runs * (6 + 8 + 3 * 11 + 14), 4: runs * (5 + 6 + 3 * 19 + 6)}
    assert list(choice["excluded"]) == [2]


def test_products_sharing_a_shape_are_weighed_by_decode_runs():
    fast_o, fast_text = _t(64, 32, 128, 4, 3), _t(64, 128, 128, 4, 3, tma=True)
    only_o = _t(64, 64, 64, 4, 4)  # failed to build on text_proj: never chosen for the shared entry
    talker_o = _result({1: [fast_o, fast_text, only_o]},
                       {fast_o: [5, 6, 7, 9], fast_text: [6, 7, 8, 10], only_o: [1, 1, 1, 1]})
    text_proj = _result({1: [fast_o, fast_text]}, {fast_o: [50, 60, 70, 90], fast_text: [1, 1, 1, 1]})
    table = bench.choose({"talker.o": talker_o, "text_proj": text_proj}, ROWS)
    assert table[(2048, 2048)]["tiles"] == [fast_o] * 4  # text_proj runs in prefills only (DECODE_RUNS 0)
    # a shape whose family is broken on one of its products has no usable split: no entry for tiles()
    text_proj["families"][1]["ok"] = False
    broken = bench.choose({"talker.o": talker_o, "text_proj": text_proj}, ROWS)[(2048, 2048)]
    assert broken["split"] is None and broken["tiles"] is None and "text_proj" in broken["excluded"][1]
    assert "no split family" in bench.swept_source({(2048, 2048): broken})


def test_the_printed_table_is_swept_as_stages_invariant_matmul_reads_it():
    table = {shape: {"tiles": list(per_bucket)} for shape, per_bucket in im.SWEPT.items()}
    text = bench.swept_source(table)
    assert text.startswith("SWEPT: dict[tuple[int, int], tuple[Tiles, Tiles, Tiles, Tiles]] = {")
    assert all(len(line) <= 120 for line in text.splitlines())
    scope = {"Tiles": im.Tiles, "_t": _t}
    exec(text, scope)
    assert scope["SWEPT"] == im.SWEPT
    assert "_t(128, 128, 64, 8, 4, tma=True, persistent=True)" in text  # variant fields only where not default
    with pytest.raises(ValueError, match="GROUP_M"):
        bench.source(im.Tiles(64, 64, 64, 4, 4, 3))
