"""deployments/coalescing.py: the arrival rate that tells a batch whether waiting for more can pay."""

from __future__ import annotations

import math

import pytest

from stages.arrival_rate import ArrivalRate


def test_arrival_rate_reads_a_steady_rate_and_decays_after_it():
    now = [0.0]
    rate = ArrivalRate(tau_s=1.0, clock=lambda: now[0])
    assert rate.per_second() == 0.0
    for _ in range(1000):  # 100 per second for 10 s
        now[0] += 0.01
        rate.add(1)
    assert rate.per_second() == pytest.approx(100, rel=0.01)
    now[0] += 3.0  # three time constants without an arrival
    assert rate.per_second() == pytest.approx(100 * math.exp(-3), rel=0.01)
