from deployments.ingress.outcomes import PlaybackClock


def test_no_underrun_when_audio_arrives_ahead():
    clock = PlaybackClock()
    clock.sent(0.16, now=0.0)  # first chunk: 2 frames
    clock.sent(0.32, now=0.05)  # lead 0.11 s
    clock.sent(2.0, now=0.20)  # lead 0.48 - 0.20 = 0.28 s
    assert clock.underruns == 0
    assert abs(clock.min_lead_s - 0.11) < 1e-9


def test_underrun_counted_once_per_gap_and_player_restarts():
    clock = PlaybackClock()
    clock.sent(0.5, now=0.0)
    clock.sent(0.5, now=0.8)  # 0.3 s gap: underrun, the player restarts at 0.8 with 0.5 s buffered... of this chunk
    assert clock.underruns == 1 and abs(clock.min_lead_s + 0.3) < 1e-9
    clock.sent(0.5, now=1.0)  # lead = 1.0 - (1.0 - 0.3) = 0.3 >= 0
    assert clock.underruns == 1
    clock.sent(0.1, now=2.0)  # lead = 1.5 - 1.7 = -0.2: a second gap
    assert clock.underruns == 2
    assert abs(clock.underrun_s - 0.5) < 1e-9
