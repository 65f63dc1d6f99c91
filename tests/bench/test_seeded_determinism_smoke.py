"""`python -m bench.seeded_determinism` (the GPU comparison of deterministic mode) runs end to end on tiny CPU shapes
and prints the JSON the integrator reads: codes and PCM identical alone and in batches, and a throughput cost."""

from __future__ import annotations

import json
import sys

from bench import seeded_determinism


def test_the_bench_prints_identical_codes_and_pcm_and_a_cost(tmp_path, monkeypatch, capsys):
    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["seeded_determinism", "--tiny", "--batches", "2,5", "--frames", "5",
                                      "--concurrency", "3", "--throughput-frames", "4", "--sustained-s", "2",
                                      "--workdir", str(tmp_path),
                                      "--out", str(out)])
    seeded_determinism.main()
    result = json.loads(out.read_text())
    assert result["alone_vs_batch"] == {"2": "identical", "5": "identical", "greedy_64": "identical"}
    assert result["pcm_alone_vs_batch"] == {"2": "identical", "5": "identical",
                                            **{f"row_{r}": "identical" for r in (0, 1, 15, 32, 63)}}
    assert set(result["throughput_cost"]) == {"talker", "code2wav"}
    for mode in ("deterministic", "default"):  # the closed loop produced frames, from steps and prefills
        sustained = result["talker_sustained"][mode]
        assert sustained["frames_per_s"] > 0 and sustained["steps"] > 0 and sustained["prefills"] > 0
    assert '"alone_vs_batch"' in capsys.readouterr().out
