"""`python -m bench.aligner_cost` (the aligner's cost per audio second, for a GPU) runs end to end on tiny CPU shapes
and prints the JSON the integrator reads: a cost per batch size."""

from __future__ import annotations

import json

import pytest

from bench import aligner_cost


def test_the_bench_writes_a_random_aligner_once_and_prints_costs_per_batch(tmp_path, capsys):
    out = tmp_path / "result.json"
    argv = ["--tiny", "--device", "cpu", "--batches", "1,3", "--seconds", "1.5", "--warmup", "0", "--repeats", "1",
            "--workdir", str(tmp_path / "work"), "--out", str(out)]
    result = aligner_cost.main(argv)
    assert json.loads(out.read_text()) == result
    assert (result["shapes"], result["dtype"], result["piece_seconds"]) == ("tiny", "float32", 1.5)
    for key in ("aligner_ms_per_audio_s", "prepare_ms_per_audio_s", "device_thread_ms_per_audio_s",
                "forward_ms_per_audio_s"):
        assert set(result[key]) == {"1", "3"} and all(ms > 0 for ms in result[key].values())
    for b in ("1", "3"):
        assert result["forward_ms_per_audio_s"][b] <= result["device_thread_ms_per_audio_s"][b]
        assert result["aligner_ms_per_audio_s"][b] == pytest.approx(
            result["prepare_ms_per_audio_s"][b] + result["device_thread_ms_per_audio_s"][b], abs=2e-4)
    assert '"aligner_ms_per_audio_s"' in capsys.readouterr().out
    (checkpoint,) = (tmp_path / "work").iterdir()
    again = aligner_cost.main([*argv[:-2]])  # the checkpoint written once is loaded again
    assert again["checkpoint"] == str(checkpoint) and list((tmp_path / "work").iterdir()) == [checkpoint]
