"""StepClock's bookkeeping against a device clock the test sets: which steps get a gap, and how long each is."""

from stages.talker.step_clock import StepClock


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


def test_steps_and_the_gaps_between_chained_steps():
    device = Device()
    clock = StepClock(lambda: FakeEvent(device))

    def step(turn: int, start_ms: float, end_ms: float) -> None:  # the step's events as the device reaches them
        device.now_ms = start_ms
        clock.begin(turn)
        device.now_ms = end_ms
        clock.end(turn)

    step(0, 0.0, 8.0)  # the first step after an idle engine: no gap
    step(1, 8.5, 16.0)  # launched while step 0 is unread: 0.5 ms between them (a prefill, say)
    clock.read(0)
    step(0, 18.0, 26.0)  # the host launched it late: 2 ms idle
    clock.read(1)
    clock.read(0)
    step(1, 100.0, 109.0)  # after everything was read (the engine idled): its gap is not one between steps
    clock.read(1)
    assert clock.step_seconds * 1e3 == 8.0 + 7.5 + 8.0 + 9.0
    assert clock.gaps == 2 and abs(clock.gap_seconds * 1e3 - 2.5) < 1e-9


def test_ring_keeps_the_events_of_steps_still_unread():
    device = Device()
    clock = StepClock(lambda: FakeEvent(device))
    t = 0.0
    step_ms, gap_ms = 3.0, 1.0
    for i in range(10):  # steady pipelining: launch i + 1, then read i
        device.now_ms = t
        clock.begin((i + 1) % 2)
        device.now_ms = t + step_ms
        clock.end((i + 1) % 2)
        t += step_ms + gap_ms
        if i:
            clock.read(i % 2)
    clock.read(10 % 2)
    assert abs(clock.step_seconds * 1e3 - 10 * step_ms) < 1e-9
    assert clock.gaps == 9 and abs(clock.gap_seconds * 1e3 - 9 * gap_ms) < 1e-9


def test_without_a_device_clock_nothing_is_recorded():
    clock = StepClock(None)
    clock.begin(0)
    clock.end(0)
    clock.read(0)
    assert clock.step_seconds == clock.gap_seconds == 0.0 and clock.gaps == 0
