"""The engine loop against a fake runner: EOS and length endings, no wasted steps, row moves, aborts.

The fake runner stands for the device: each row's "codes" are a pure function of (seed, frame), and a seed
can script an EOS (`seed // 1000` = the frame after which codebook 0 becomes EOS; seed 999 = EOS sampled at
prefill). So every frame a stream receives can be checked, whatever row it ran in and however rows moved.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from stages.chunking import ChunkSchedule
from stages.contract import FinishReason, SamplingParams, SynthesisRequest
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.talker.engine import TalkerEngine, TalkerEngineConfig
from stages.talker.step_clock import DeviceClockStats, StepClock

EOS = 2150
EOS_AT_PREFILL = 999


def frame_codes(seed: int, frame: int) -> np.ndarray:
    return (seed * 31 + frame * 7 + np.arange(16) * 3) % 2048


class FakeRunner:
    """Rows of (seed, frame index); a step emits frame_codes and the next codebook-0 (EOS when scripted)."""

    def __init__(self, model, config, num_blocks):
        self.eos, self.length_buckets = EOS, (config.max_seq_len,)
        self.max_prefill_batch = config.max_prefill_batch
        self.rows: list[list[int] | None] = [None] * config.max_num_seqs
        self.outputs: list[np.ndarray] = [np.zeros((0, 17), dtype=np.int64)] * 2
        self.turn = 0
        self.launches = 0
        self.rows_launched: list[int] = []
        self.codes_read: list[int] = []  # turns whose frame codes the engine read before their whole output
        self.step_clock = StepClock(None)  # no device clock

    def attn_bucket(self, position: int) -> int:
        return self.length_buckets[0]

    def prefill_fits(self, n: int, width: int) -> bool:
        return n <= self.max_prefill_batch

    def admit(self, batch) -> None:
        for a in batch:
            self.rows[a.row] = [a.seed, 0]

    def launch_step(self, b: int, attn_len: int) -> int:
        self.launches += 1
        out = np.zeros((b, 17), dtype=np.int64)
        live = 0
        for row in range(b):
            state = self.rows[row]
            if state is None:
                continue
            live += 1
            seed, frame = state
            out[row, :16] = frame_codes(seed, frame)
            if seed == EOS_AT_PREFILL and frame == 0:
                out[row, 0] = EOS
            out[row, 16] = EOS if seed // 1000 and frame + 1 == seed // 1000 else 1
            state[1] += 1
        self.rows_launched.append(live)
        turn, self.turn = self.turn, self.turn ^ 1
        self.outputs[turn] = out
        return turn

    def step_codes(self, turn: int, n: int) -> np.ndarray:
        self.codes_read.append(turn)
        return self.outputs[turn][:n, :16]

    def step_output(self, turn: int, n: int) -> np.ndarray:
        return self.outputs[turn][:n]

    def move_rows(self, moves: list[tuple[int, int, int]]) -> None:
        sources = [self.rows[src] for src, _, _ in moves]  # all at once, as the runner's gather + scatter
        for (_, dst, _), state in zip(moves, sources, strict=True):
            self.rows[dst] = state

    def free_rows(self, start: int, stop: int) -> None:
        self.rows[start:stop] = [None] * (stop - start)


@pytest.fixture(scope="module")
def model(tiny_custom_voice) -> Qwen3TTS:
    return Qwen3TTS.load(tiny_custom_voice, dtype="float32", decoder=False)


@pytest.fixture(scope="module")
def prompt(model):
    return build_prompt(model.config, model.tokenizer, "Hello there.", speaker="ryan", language="english")


def _engine(model, **kw) -> TalkerEngine:
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, kernels={"exact_prefill": False}, **kw), FakeRunner)
    engine.start(log=lambda _m: None)
    return engine


async def _collect(engine, request, schedule=None):
    stream = engine.add_request(request, schedule)
    chunks = [c async for c in stream]
    frames = np.concatenate([c.codes[c.context:] for c in chunks]) if chunks else np.zeros((0, 16), np.int64)
    return frames, stream.finish_reason, chunks


def test_every_stream_gets_its_own_frames_through_joins_leaves_and_row_moves(model, prompt):
    """12 requests through 4 rows, ending by EOS at scripted frames or by length: rows move on every
    release, and each stream still receives exactly its own frames in order."""
    G = SamplingParams(do_sample=False, subtalker_do_sample=False)
    specs = [(i + 1000 * (3 + i % 5) if i % 3 else i, 4 + 2 * i) for i in range(12)]  # (seed, max_frames)
    engine = _engine(model, max_num_seqs=4)
    try:
        async def main():
            return await asyncio.gather(*[_collect(engine, SynthesisRequest(f"r{i}", prompt, G, n, seed=seed))
                                          for i, (seed, n) in enumerate(specs)])
        results = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    for (seed, max_frames), (frames, reason, chunks) in zip(specs, results, strict=True):
        eos_after = seed // 1000
        expected = min(max_frames, eos_after) if eos_after else max_frames
        assert len(frames) == expected, (seed, max_frames)
        np.testing.assert_array_equal(frames, np.stack([frame_codes(seed, f) for f in range(expected)]))
        ended_by_eos = bool(eos_after) and eos_after <= max_frames
        assert reason is (FinishReason.EOS if ended_by_eos else FinishReason.LENGTH)
        assert chunks[-1].final and chunks[-1].finish_reason is reason
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_reserved_tokens == 0
    # every request was admitted once and handed a first chunk with frames; 8 of them waited for a row
    assert stats.admitted == 12 and stats.first_chunks == 12
    assert 0 < stats.admission_wait_seconds < stats.first_chunk_seconds


def test_no_step_is_launched_that_no_row_can_use(model, prompt):
    """Length limits are known ahead: 5 frames take exactly 5 steps, so the next prefill never waits."""
    engine = _engine(model, max_num_seqs=2)
    try:
        frames, reason, _ = asyncio.run(_collect(engine, SynthesisRequest("n", prompt, max_frames=5, seed=1)))
        launches = engine.runner.launches
    finally:
        engine.shutdown()
    assert len(frames) == 5 and reason is FinishReason.LENGTH
    assert launches == 5


def test_eos_at_prefill_gives_an_empty_stream(model, prompt):
    engine = _engine(model, max_num_seqs=2)
    try:
        frames, reason, chunks = asyncio.run(_collect(engine, SynthesisRequest("e", prompt, max_frames=9,
                                                                               seed=EOS_AT_PREFILL)))
    finally:
        engine.shutdown()
    assert len(frames) == 0 and reason is FinishReason.EOS
    assert len(chunks) == 1 and chunks[0].final and chunks[0].num_new == 0


def test_chunks_follow_the_requests_own_schedule(model, prompt):
    schedule = ChunkSchedule(first_chunk_frames=1, steady_chunk_frames=3, left_context_frames=2, ramp=())
    engine = _engine(model, max_num_seqs=2)
    try:
        frames, _, chunks = asyncio.run(_collect(engine, SynthesisRequest("c", prompt, max_frames=8, seed=5),
                                                 schedule))
    finally:
        engine.shutdown()
    assert [c.num_new for c in chunks] == [1, 3, 3, 1]
    assert [c.context for c in chunks] == [0, 1, 2, 2]
    assert len(frames) == 8


class FaultyRunner(FakeRunner):
    """Admitting a request with seed 666 raises (a bad batch); a step with seed 777 running raises (device fault);
    seed 555 makes steps wait until released (a request that stays running)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import threading

        self.release_hold = threading.Event()

    def admit(self, batch) -> None:
        if any(a.seed == 666 for a in batch):
            raise ValueError("bad admission batch")
        super().admit(batch)

    def launch_step(self, b: int, attn_len: int) -> int:
        seeds = {state[0] for state in self.rows[:b] if state is not None}
        if 777 in seeds:
            raise RuntimeError("device fault")
        if 555 in seeds:
            self.release_hold.wait(timeout=30)
        return super().launch_step(b, attn_len)


def _faulty_engine(model, **kw) -> TalkerEngine:
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, kernels={"exact_prefill": False}, **kw), FaultyRunner)
    engine.start(log=lambda _m: None)
    return engine


def test_a_failed_admission_fails_only_its_batch(model, prompt):
    engine = _faulty_engine(model, max_num_seqs=4, max_prefill_batch=1)
    try:
        async def main():
            bad = asyncio.create_task(_collect(engine, SynthesisRequest("bad", prompt, max_frames=5, seed=666)))
            with pytest.raises(ValueError, match="bad admission"):
                await bad
            return await _collect(engine, SynthesisRequest("after", prompt, max_frames=6, seed=3))
        frames, reason, _ = asyncio.run(main())
        stats, ready = engine.stats(), engine.ready
    finally:
        engine.shutdown()
    assert len(frames) == 6 and reason is FinishReason.LENGTH  # the engine survived and serves the next one
    assert ready and stats.running == 0 and stats.kv_reserved_tokens == 0


def test_a_failed_prefill_in_a_burst_fails_its_batch_alone(model, prompt):
    """Three requests at once, one per prefill, up to 4 prefills per iteration (no stream plays yet: one burst):
    the first prefill fails (its request alone, its row filled by a later one), the other two are prefilled in
    the same iteration, before the same step. Only prefills that ran are counted."""
    import threading

    engine = _faulty_engine(model, max_num_seqs=4, max_prefill_batch=1, max_prefills_per_step=4)
    admitted = []
    engine.on_admit = lambda ids: admitted.append((ids[0], engine.stats().steps))
    try:
        async def main():
            release, held = threading.Event(), threading.Event()
            engine.run_on_device(lambda: held.set() or release.wait())  # one drain takes all three
            held.wait()
            streams = [engine.add_request(SynthesisRequest(rid, prompt, max_frames=5, seed=seed))
                       for rid, seed in (("bad", 666), ("ok1", 1), ("ok2", 2))]
            release.set()
            with pytest.raises(ValueError, match="bad admission"):
                await _drain(streams[0])
            return [await _drain(s) for s in streams[1:]], [s.finish_reason for s in streams[1:]]
        (ok1, ok2), reasons = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert [rid for rid, _ in admitted] == ["ok1", "ok2"] and admitted[0][1] == admitted[1][1]
    assert stats.prefills == 2 and stats.burst_prefills == 1
    assert reasons == [FinishReason.LENGTH, FinishReason.LENGTH]
    assert sum(c.num_new for c in ok1) == 5 and sum(c.num_new for c in ok2) == 5


async def _drain(stream):
    return [c async for c in stream]


def test_a_device_fault_fails_every_stream_and_new_requests(model, prompt):
    engine = _faulty_engine(model, max_num_seqs=4)
    try:
        async def main():
            streams = [engine.add_request(SynthesisRequest(f"r{seed}", prompt, max_frames=50, seed=seed))
                       for seed in (1, 777)]
            outcomes = []
            for stream in streams:
                try:
                    await asyncio.wait_for(_drain(stream), 60)
                    outcomes.append(stream.finish_reason)
                except RuntimeError as e:
                    outcomes.append(str(e))
            with pytest.raises(RuntimeError, match="failed"):
                engine.add_request(SynthesisRequest("late", prompt, max_frames=5, seed=2))
            return outcomes
        outcomes = asyncio.run(main())
    finally:
        engine.shutdown()
    assert outcomes == ["device fault", "device fault"]
    assert not engine.ready
    with pytest.raises(RuntimeError, match="failed"):
        engine.check_health()


def test_shutdown_ends_open_streams_with_an_error(model, prompt):
    engine = _faulty_engine(model, max_num_seqs=2)

    async def main():
        stream = engine.add_request(SynthesisRequest("open", prompt, max_frames=200, seed=555))
        engine.on_admit = None
        first = asyncio.get_running_loop().run_in_executor(None, engine.shutdown)  # the loop holds 555's step
        engine.runner.release_hold.set()
        await first
        async def drain():
            return [c async for c in stream]

        with pytest.raises(RuntimeError, match="shut down"):
            await asyncio.wait_for(drain(), 60)  # a stream left open would hang here: bounded, it fails instead
    asyncio.run(main())


class LiveFakeRunner(FakeRunner):
    """FakeRunner with the live-text device calls: parked rows keep (seed, frame) by slot."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.parked: dict[int, list[int]] = {}
        self.text_rows = 0

    def park_rows(self, rows: list[int], slots: list[int]) -> None:
        for row, slot in zip(rows, slots, strict=True):
            self.parked[slot] = list(self.rows[row])

    def unpark_row(self, slot: int, row: int) -> None:
        self.rows[row] = self.parked.pop(slot)

    def write_text(self, writes) -> None:
        self.text_rows += sum(len(ids) for _, _, ids in writes)


def test_live_requests_park_and_resume_through_row_moves(model, prompt):
    """12 live requests (text in random pieces at random times) and 4 plain ones through 5 rows: requests park,
    resume, join and leave all the time, and every stream still receives exactly its own frames."""
    import random

    from stages.prompts import build_live_prompt

    live_prompt = build_live_prompt(model.config, model.tokenizer, speaker="ryan", language="english")
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, kernels={"exact_prefill": False}, max_num_seqs=5),
                          LiveFakeRunner)
    engine.start(log=lambda _m: None)
    rng = random.Random(5)
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    try:
        async def live(i):
            stream = engine.open_request(SynthesisRequest(f"l{i}", live_prompt, max_frames=30, seed=100 + i))

            async def feed():
                for w in rng.sample(words, 6):
                    for piece in (w[:2], w[2:] + " "):
                        await asyncio.sleep(rng.random() * 0.01)
                        engine.append_text(f"l{i}", piece)
                engine.end_text(f"l{i}")
            feeder = asyncio.create_task(feed())
            frames = [c.codes[c.context:] async for c in stream]
            await feeder
            return 100 + i, 30, np.concatenate(frames), stream.finish_reason

        async def plain(i):
            frames, reason, _ = await _collect(engine, SynthesisRequest(f"p{i}", prompt, max_frames=20 + i, seed=i))
            return i, 20 + i, frames, reason

        async def main():
            return await asyncio.gather(*[live(i) for i in range(12)], *[plain(i) for i in range(4)])
        results = asyncio.run(main())
        stats, parks, unparks = engine.stats(), engine.counters.parks, engine.counters.unparks
    finally:
        engine.shutdown()
    for seed, n, frames, reason in results:
        np.testing.assert_array_equal(frames, np.stack([frame_codes(seed, f) for f in range(n)]), err_msg=str(seed))
        assert reason is FinishReason.LENGTH
    assert parks >= 5 and unparks >= 5  # they really waited (typically ~25 times)
    assert stats.running == stats.parked == stats.held == stats.waiting == 0 and stats.kv_reserved_tokens == 0


def test_stats_while_the_runner_is_still_being_built(model):
    """A start-up takes long (graph capture) and stats may be read meanwhile: the device clock reads zero then."""
    building, release = threading.Event(), threading.Event()

    class SlowRunner(FakeRunner):
        def __init__(self, *args, **kwargs):
            building.set()
            release.wait()
            super().__init__(*args, **kwargs)

    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, kernels={"exact_prefill": False}), SlowRunner)
    starter = threading.Thread(target=engine.start, args=(lambda _: None,))
    starter.start()
    try:
        assert building.wait(60)
        stats = engine.stats()
        assert stats.device_clock == DeviceClockStats() and stats.steps == 0
    finally:
        release.set()
        starter.join()
        engine.shutdown()


class GatedRunner(FakeRunner):
    """A FakeRunner whose admissions wait for `gate` (set by the test), signalling `entered` first: a prefill that
    takes as long as the test wants."""

    entered = threading.Event()
    gate = threading.Event()

    def admit(self, batch) -> None:
        GatedRunner.entered.set()
        GatedRunner.gate.wait(60)
        super().admit(batch)


class SteppedClock:
    """The engine module's `time` with a monotonic clock the test moves (`advance`); everything else real."""

    def __init__(self) -> None:
        import time

        self._time, self.now = time, 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name: str):
        return getattr(self._time, name)


def test_a_request_reaching_an_idle_engine_is_not_taken_for_a_stall(model, prompt, monkeypatch):
    """The heartbeat restarts when work reaches an engine that waited for some: a request arriving after longer
    idleness than `stall_timeout_s` is healthy while its prefill runs (Serve would otherwise replace the replica and
    fail the stream), and a prefill that itself takes longer than `stall_timeout_s` is still a stall. The engine's
    monotonic clock is the test's, so no wall-clock margin is involved."""
    from stages.talker import engine as engine_module

    clock = SteppedClock()
    monkeypatch.setattr(engine_module, "time", clock)
    stall_s = 60.0
    GatedRunner.entered.clear()
    GatedRunner.gate.clear()
    engine = TalkerEngine(model, TalkerEngineConfig(max_seq_len=256, max_num_seqs=2, stall_timeout_s=stall_s,
                                                    kernels={"exact_prefill": False}), GatedRunner)
    engine.start(log=lambda _m: None)
    try:
        clock.advance(10 * stall_s)  # idle for longer than the stall timeout
        engine.check_health()

        async def main():
            stream = engine.add_request(SynthesisRequest("late", prompt, max_frames=3, seed=1))
            assert await asyncio.to_thread(GatedRunner.entered.wait, 60)
            engine.check_health()  # its prefill is running: work pending, but the idle time before it is no stall
            clock.advance(2 * stall_s)  # the prefill now takes longer than the stall timeout
            with pytest.raises(RuntimeError, match="made no progress"):
                engine.check_health()
            GatedRunner.gate.set()
            return [c async for c in stream], stream.finish_reason
        chunks, reason = asyncio.run(main())
    finally:
        GatedRunner.gate.set()
        engine.shutdown()
    assert reason == FinishReason.LENGTH and sum(c.num_new for c in chunks) == 3
