"""bench.pipeline's per-stream playback accounting agrees with the load generator's continuity metric."""

import numpy as np
import pytest

from bench.loadgen.metrics import continuity
from bench.pipeline import playback_deficits


def test_deficit_matches_loadgen_continuity_and_names_the_worst_chunk():
    decoded = [0.10, 0.15, 0.45, 0.50, 1.60]
    audio = [0.08, 0.16, 0.32, 0.64, 0.40]
    heard, worst, deficit = playback_deficits(decoded, audio)
    assert deficit == pytest.approx(continuity(decoded, audio).max_deficit_s)
    # chunk 2 is due 0.24 s after the first audio and comes at 0.35 s; chunk 4 due at 1.20, comes at 1.50
    assert worst == 4 and deficit == pytest.approx(0.30)
    np.testing.assert_allclose(heard, decoded)


def test_a_chunk_decoded_before_an_earlier_one_is_heard_only_after_it():
    heard, worst, deficit = playback_deficits([0.0, 0.5, 0.3], [0.08, 0.08, 0.08])
    np.testing.assert_allclose(heard, [0.0, 0.5, 0.5])  # chunk 2 waits for chunk 1
    assert worst == 1 and deficit == pytest.approx(0.42)  # due at 0.08 s, heard at 0.5 s


def test_a_stream_ahead_of_its_player_has_no_deficit():
    _, _, deficit = playback_deficits([0.0, 0.01, 0.02], [1.0, 1.0, 1.0])
    assert deficit == 0.0
