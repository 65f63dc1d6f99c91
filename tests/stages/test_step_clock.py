"""StepClock's bookkeeping against a device clock the test sets: which steps get a gap, of which kind, how long."""

import pytest

from stages.talker.step_clock import DeviceClockStats, StepClock, window_ms


class Device:
    """A fake GPU clock: an event records the time the test says the stream reached it."""

    def __init__(self):
        self.now_ms = 0.0


class FakeEvent:
    def __init__(self, device: Device):
        self.device, self.at_ms = device, None

    def record(self) -> None:
        self.at_ms = self.device.now_ms

    def elapsed_time(self, end: "FakeEvent") -> float:
        return end.at_ms - self.at_ms


@pytest.fixture
def device() -> Device:
    return Device()


def _step(clock: StepClock, device: Device, start_ms: float, end_ms: float) -> None:
    device.now_ms = start_ms  # the step's events as the device reaches them
    clock.begin()
    device.now_ms = end_ms
    clock.end()


def test_steps_and_the_gaps_between_chained_steps(device):
    clock = StepClock(lambda: FakeEvent(device))
    _step(clock, device, 0.0, 8.0)  # the first step after an idle engine: no gap
    _step(clock, device, 8.5, 16.0)  # launched while step 0 is unread: 0.5 ms of idle device between them
    clock.read()
    device.now_ms = 17.0  # the device reaches the first prefill 1 ms after step 1 ended (the host staged it late)
    clock.prefill_begin()
    device.now_ms = 18.0
    clock.prefill_end()
    device.now_ms = 99.0  # a second prefill in the same gap: no new beginning, a new end
    clock.prefill_begin()
    device.now_ms = 19.5
    clock.prefill_end()
    _step(clock, device, 20.0, 28.0)  # prefills ran between: a prefill gap of 4 ms, 1 ms before them, 2.5 theirs
    clock.read()
    _step(clock, device, 31.0, 39.0)  # the host launched it 3 ms late: a long idle gap
    clock.read()
    clock.read()
    _step(clock, device, 100.0, 109.0)  # after everything was read (the engine idled): no gap between steps
    clock.read()
    s = clock.stats
    assert s.steps == 5 and s.step_seconds * 1e3 == pytest.approx(8.0 + 7.5 + 8.0 + 8.0 + 9.0)
    assert s.idle_gaps == 2 and s.idle_gap_seconds * 1e3 == pytest.approx(3.5)
    assert s.long_idle_gaps == 1 and s.long_idle_gap_seconds * 1e3 == pytest.approx(3.0)
    assert s.prefill_gaps == 1 and s.prefill_gap_seconds * 1e3 == pytest.approx(4.0)
    assert s.prefill_wait_seconds * 1e3 == pytest.approx(1.0)
    assert s.prefill_device_seconds * 1e3 == pytest.approx(2.5)
    window = window_ms(DeviceClockStats(), s)
    assert window["gpu_prefill_device_ms"] == pytest.approx(2.5 / 5)
    assert window["gpu_ms_per_prefill_gap"] == pytest.approx(2.5)
    assert window["gpu_step_ms"] == pytest.approx(40.5 / 5) and window["gpu_idle_gap_ms"] == pytest.approx(3.5 / 5)
    assert window["gpu_long_idle_gaps"] == 1 and window["gpu_long_idle_gap_mean_ms"] == pytest.approx(3.0)


def test_the_ring_keeps_the_events_of_steps_still_unread(device):
    clock = StepClock(lambda: FakeEvent(device))
    t, step_ms, gap_ms = 0.0, 3.0, 0.25
    for i in range(10):  # steady pipelining: launch step i, then read step i - 1
        _step(clock, device, t, t + step_ms)
        t += step_ms + gap_ms
        if i:
            clock.read()
    clock.read()
    s = clock.stats
    assert s.step_seconds * 1e3 == pytest.approx(10 * step_ms)
    assert s.idle_gaps == 9 and s.idle_gap_seconds * 1e3 == pytest.approx(9 * gap_ms) and s.long_idle_gaps == 0


def test_a_prefill_that_fails_before_its_end_leaves_a_recorded_end(device):
    clock = StepClock(lambda: FakeEvent(device))
    _step(clock, device, 0.0, 8.0)
    device.now_ms = 9.0
    clock.prefill_begin()  # its launch raised: no prefill_end
    _step(clock, device, 9.5, 17.0)
    clock.read()
    clock.read()
    s = clock.stats
    assert s.prefill_gaps == 1 and s.prefill_wait_seconds * 1e3 == pytest.approx(1.0)
    assert s.prefill_device_seconds == 0.0


def test_without_a_device_clock_nothing_is_recorded():
    clock = StepClock(None)
    clock.prefill_begin()
    clock.prefill_end()
    clock.begin()
    clock.end()
    clock.read()
    assert clock.stats == DeviceClockStats() and clock.recent_steps() == {}


def test_recent_steps_tell_a_slow_device_from_a_late_host(device):
    """`recent_steps`: the launch intervals while the engine was busy, and in the long ones (> 30 ms) the share the
    device spent on the step that began them; an interval after an idle engine (nothing unread) is no stall."""
    host = [0.0]
    clock = StepClock(lambda: FakeEvent(device), host_clock=lambda: host[0])
    assert clock.recent_steps() == {}

    def step(host_ms: float, device_ms: float) -> None:
        host[0] = host_ms / 1e3
        _step(clock, device, host_ms, host_ms + device_ms)

    step(0.0, 8.0)
    step(8.0, 8.0)  # behind the unread first: a busy interval of 8 ms
    clock.read()
    step(16.0, 40.0)  # 8 ms after the last
    clock.read()
    step(56.0, 8.0)  # 40 ms after: the step before ran 40 ms on the device (a slow device)
    clock.read()
    step(106.0, 8.0)  # 50 ms after an 8-ms step: the host launched 42 ms late
    clock.read()
    clock.read()
    step(500.0, 8.0)  # after everything was read: the engine idled, not a stall
    clock.read()
    recent = clock.recent_steps()
    assert recent["steps"] == 6 and recent["long_intervals"] == 2
    assert recent["launch_interval_ms"][-1] == pytest.approx(50.0)  # the idle interval is not counted
    assert recent["gpu_step_ms"][-1] == pytest.approx(40.0)
    assert recent["long_interval_gpu_share"] == pytest.approx((40 + 8) / (40 + 50), abs=1e-3)
