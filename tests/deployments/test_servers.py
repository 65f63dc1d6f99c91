"""The deployment classes without Serve (`sync_init` + `start`), on the real engines and a tiny checkpoint: the Talker's
streams, Code2Wav's batches, health and traces (the fixtures: tests/deployments/conftest.py; the Talker's
first-chunk decoder: test_first_chunk_decoder_server.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from deployments.code2wav.server import Code2WavServer
from deployments.config import CheckpointSource, Code2WavDeploymentConfig, TalkerDeploymentConfig
from deployments.errors import APIError
from deployments.messages import GenerateOptions
from stages.contract import SAMPLES_PER_FRAME, FinishReason
from tests.deployments.server_requests import STREAMING, collect, longest_request, request_for


def test_talker_streams_scheduled_chunks_with_left_context(loop, talker):
    chunks = loop.run_until_complete(collect(talker.generate(request_for(talker, 13))))
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert [c.num_new for c in chunks] == [2, 4, 5, 2]  # first, ramp (x2), steady, final partial
    assert [c.context for c in chunks] == [0, 2, 3, 3]
    assert chunks[-1].final and chunks[-1].finish_reason is FinishReason.LENGTH
    assert not any(c.final for c in chunks[:-1])
    for prev, cur in zip(chunks, chunks[1:], strict=False):  # context = the last frames already sent
        np.testing.assert_array_equal(cur.codes[:cur.context], prev.codes[-cur.context:])


def test_talker_options_first_chunk_and_the_kv_fit_rule(loop, talker):
    """The request's own first chunk; the engine takes exactly the frames `max_frames_that_fit` allows (the rule the
    ingress fits requests with) and refuses one more."""
    from stages.contract import InvalidRequestError

    request = longest_request(talker, "fits")
    chunks = loop.run_until_complete(collect(talker.generate(request, GenerateOptions(1))))
    assert chunks[0].num_new == 1
    assert sum(c.num_new for c in chunks) == request.max_frames
    with pytest.raises(InvalidRequestError):
        too_long = dataclasses.replace(request, request_id="too-long", max_frames=request.max_frames + 1)
        loop.run_until_complete(collect(talker.generate(too_long)))
    info = loop.run_until_complete(talker.info())
    assert info.max_seq_len == 64 and info.speakers[0] == "aiden"


def test_closing_the_stream_aborts_the_request_and_frees_the_slot(loop, talker):
    async def first_then_close():
        agen = talker.generate(longest_request(talker, "gone"))
        first = await anext(agen)
        assert talker.record_autoscaling_stats()["running"] == 1
        await agen.aclose()  # queues the abort on the engine's command queue
        # a device call queued after it runs once the abort was handled (one FIFO queue): no clock involved
        running = await asyncio.wrap_future(talker._engine.run_on_device(lambda: talker._engine.stats().running))
        assert running == 0, "the aborted request still holds its row"
        return first

    first = loop.run_until_complete(first_then_close())
    assert first.seq == 0
    stats = loop.run_until_complete(talker.engine_stats())
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert set(talker.record_autoscaling_stats()) == {"waiting", "running", "slots"}


def test_the_servers_hold_engines_of_their_protocols(talker, code2wav):
    from deployments.code2wav.engine_protocol import Code2WavEngineProtocol
    from deployments.talker.engine_protocol import TalkerEngineProtocol

    assert isinstance(talker._engine, TalkerEngineProtocol)
    assert isinstance(code2wav._engine, Code2WavEngineProtocol)


def test_code2wav_decodes_many_streams_in_one_call_like_single_decodes(loop, talker, code2wav):
    streams = [loop.run_until_complete(collect(talker.generate(request_for(talker, 9, rid=f"s{i}", seed=i))))
               for i in range(3)]
    chunks = [c for s in streams for c in s]
    before = code2wav._engine.stats().batches

    batched = loop.run_until_complete(code2wav.decode_many(chunks))
    assert code2wav._engine.stats().batches == before + 1  # one engine call for every stream's chunks
    assert code2wav.record_autoscaling_stats()["inflight_chunks"] == 0
    for chunk, out in zip(chunks, batched, strict=True):
        assert (out.request_id, out.seq, out.final) == (chunk.request_id, chunk.seq, chunk.final)
        assert out.pcm.dtype == np.int16 and out.pcm.size == chunk.num_new * SAMPLES_PER_FRAME
        single = loop.run_until_complete(code2wav.decode(chunk))
        np.testing.assert_allclose(single.pcm, out.pcm, atol=2)  # batch padding is exact up to float noise


def _gate_decoder(code2wav, monkeypatch):
    """Holds the decoder thread in its first batch until released; -> (entered, gate, batch sizes, batch seqs)."""
    import threading

    engine = code2wav._engine
    real_decode, entered, gate, batches = engine.decode, threading.Event(), threading.Event(), []

    def gated(work, **kwargs):
        batches.append([c.seq for c in work])
        entered.set()
        gate.wait(60)  # the first batch holds the thread until the other calls are waiting
        return real_decode(work, **kwargs)

    monkeypatch.setattr(engine, "decode", gated)
    return entered, gate, batches


async def _calls_while_busy(code2wav, entered, gate, first_call, later_calls):
    """`first_call` occupies the decoder; `later_calls` arrive while it decodes; -> every call's answers."""
    first = asyncio.ensure_future(code2wav.decode_many(first_call))
    await asyncio.get_running_loop().run_in_executor(None, entered.wait, 60)
    rest = [asyncio.ensure_future(code2wav.decode_many(call)) for call in later_calls]
    for _ in range(100):  # loop turns until every later call waits for the thread
        if sum(len(c) for c, _ in code2wav._batches.waiting) == sum(len(call) for call in later_calls):
            break
        await asyncio.sleep(0)
    gate.set()
    return await asyncio.gather(first, *rest)


def test_code2wav_decodes_calls_that_arrive_during_a_decode_as_one_batch(loop, talker, code2wav, monkeypatch):
    """Several ingress replicas' calls: those waiting while the decoder thread is busy go into one engine call."""
    chunks = loop.run_until_complete(collect(talker.generate(request_for(talker, 20, rid="together"))))
    assert len(chunks) >= 4
    entered, gate, batches = _gate_decoder(code2wav, monkeypatch)
    later = [[c] for c in chunks[1:]]  # all wait together
    answers = loop.run_until_complete(_calls_while_busy(code2wav, entered, gate, chunks[:1], later))
    assert batches == [[0], [c.seq for c in chunks[1:]]]
    assert [a.seq for (a,) in answers] == [c.seq for c in chunks]
    for chunk, (answer,) in zip(chunks, answers, strict=True):
        assert answer.pcm.size == chunk.num_new * SAMPLES_PER_FRAME


def test_code2wav_batch_waits_to_fill_but_never_with_a_streams_first_chunks(loop, talker, code2wav, monkeypatch):
    """`batch_fill_chunks`: a batch of later chunks waits for more (here until the third arrives: the wait is far
    longer than the test), while a batch holding a stream's first or second chunk leaves at once."""
    a = loop.run_until_complete(collect(talker.generate(request_for(talker, 20, rid="fill"))))
    assert len(a) >= 5
    monkeypatch.setattr(code2wav, "_config", code2wav._config.model_copy(
        update={"batch_fill_chunks": 3, "batch_fill_wait_ms": 60_000.0, "batch_fill_idle_wait_ms": 0.0}))
    engine, batches = code2wav._engine, []
    real_decode = engine.decode
    monkeypatch.setattr(engine, "decode",
                        lambda work, **kw: batches.append([c.seq for c in work]) or real_decode(work, **kw))
    coalescer = code2wav._batches

    async def scenario():
        held = coalescer.held
        calls = [asyncio.ensure_future(code2wav.decode_many([a[2]]))]
        while coalescer.held == held:  # loop turns until the batch of one later chunk holds
            await asyncio.sleep(0)
        calls.append(asyncio.ensure_future(code2wav.decode_many([a[3]])))
        for _ in range(20):  # two chunks: still short of three, nothing decodes
            await asyncio.sleep(0)
        assert batches == [] and not any(c.done() for c in calls)
        calls.append(asyncio.ensure_future(code2wav.decode_many([a[4]])))
        answers = await asyncio.gather(*calls)
        first_two = await code2wav.decode_many([a[0], a[1]])  # a listener waits: no hold
        return held, answers, first_two

    held, answers, first_two = loop.run_until_complete(scenario())
    assert batches == [[2, 3, 4], [0, 1]]
    assert coalescer.held == held + 1  # the first-chunk batch did not wait
    assert [answer.seq for (answer,) in answers] == [2, 3, 4] and [x.seq for x in first_two] == [0, 1]
    for chunk, (answer,) in zip(a[2:5], answers, strict=True):
        assert answer.pcm.size == chunk.num_new * SAMPLES_PER_FRAME


def test_code2wav_batch_does_not_wait_when_chunks_arrive_seldom(loop, talker, code2wav, monkeypatch):
    """At light load (here one chunk every 200 ms against a 20 ms wait) no second chunk is expected within the
    wait: a batch of later chunks leaves at once; a burst of arrivals makes the next one wait again."""
    a = loop.run_until_complete(collect(talker.generate(request_for(talker, 20, rid="seldom"))))
    assert len(a) >= 5
    now = [1000.0]
    monkeypatch.setattr(code2wav, "_clock", lambda: now[0])
    monkeypatch.setattr(code2wav, "_config", code2wav._config.model_copy(
        update={"batch_fill_chunks": 64, "batch_fill_wait_ms": 20.0, "batch_fill_idle_wait_ms": 0.0}))
    coalescer, held = code2wav._batches, code2wav._batches.held
    for chunk in a[2:5]:
        now[0] += 10.0  # long after any earlier arrival: the rate has decayed
        loop.run_until_complete(code2wav.decode_many([chunk]))
        now[0] += 0.2
    assert coalescer.held == held
    burst = [a[2]] * 63  # 63 chunks at one instant (well above 1 per 20 ms), short of the 64 that end a wait
    assert code2wav._fill_time([burst]) == 0.0  # not yet counted as arrivals
    code2wav._arrivals.add(len(burst))
    assert code2wav._fill_time([burst]) == pytest.approx(0.020)
    last = a[-1]
    assert last.final and not a[2].final
    assert code2wav._fill_time([burst[:62] + [last]]) == pytest.approx(0.020)  # a busy decoder: a last chunk waits too


def test_code2wav_batch_waits_longer_while_the_decoder_is_mostly_idle(loop, talker, code2wav, monkeypatch):
    """`batch_fill_idle_wait_ms`: while the decoder was busy less than half of the last second, a batch of later
    chunks waits that long and one with a stream's last chunk leaves at once; once decodes keep it busy, the
    usual `batch_fill_wait_ms` applies again, to a batch with a last chunk too."""
    a = loop.run_until_complete(collect(talker.generate(request_for(talker, 20, rid="idle"))))
    last = a[-1]
    assert len(a) >= 5 and last.final
    now = [5000.0]
    monkeypatch.setattr(code2wav, "_clock", lambda: now[0])
    monkeypatch.setattr(code2wav, "_config", code2wav._config.model_copy(
        update={"batch_fill_chunks": 64, "batch_fill_wait_ms": 20.0, "batch_fill_idle_wait_ms": 60.0}))
    burst = [a[2]] * 32
    code2wav._arrivals.add(64)  # 64 a second: one more expected within either wait
    code2wav._busy.add(0.1)  # decoding 0.1 s of the last second
    assert code2wav._fill_time([burst]) == pytest.approx(0.060)
    assert code2wav._fill_time([burst + [last]]) == 0.0
    assert code2wav._fill_time([[a[1]] + burst]) == 0.0  # a stream's second chunk never waits
    loop.run_until_complete(code2wav.decode_many(a[2:5]))  # a real decode is counted as busy time
    assert code2wav._busy.per_second() > 0.1
    code2wav._busy.add(0.8)  # busy most of the last second
    assert code2wav._fill_time([burst]) == pytest.approx(0.020)
    assert code2wav._fill_time([burst + [last]]) == pytest.approx(0.020)  # busy: a last chunk waits too
    now[0] += 30.0  # long idle since: the busy share decays
    code2wav._arrivals.add(64)
    assert code2wav._fill_time([burst]) == pytest.approx(0.060)


def test_code2wav_rejects_a_malformed_chunk_alone(loop, talker, code2wav):
    from stages.contract import CodecChunk

    bad = CodecChunk("bad", 0, np.full((3, 16), 5000, dtype=np.int64), 0)
    with pytest.raises(ValueError, match="codes outside"):
        loop.run_until_complete(code2wav.decode(bad))
    good = loop.run_until_complete(collect(talker.generate(request_for(talker, 4, rid="good"))))
    answers = loop.run_until_complete(code2wav.decode_many([good[0], bad, *good[1:]]))
    assert isinstance(answers[1], ValueError) and "codes outside" in str(answers[1])
    assert [a.request_id for i, a in enumerate(answers) if i != 1] == ["good"] * len(good)


def test_code2wav_health_fails_when_pending_chunks_see_no_decode(loop):
    """The heartbeat: chunks pending and no decode finished for `stall_timeout_s` -> check_health raises."""
    import threading

    from deployments.metrics import Code2WavMetrics
    from stages.contract import CodecChunk

    class StuckDecoder:  # a device call that does not return until the test says so
        def __init__(self):
            self.entered, self.release = threading.Event(), threading.Event()

        stateful = False

        def check_chunk(self, chunk, index):
            pass

        def decode(self, chunks, checked=False):
            self.entered.set()
            self.release.wait(30)
            return [np.zeros(c.num_new * SAMPLES_PER_FRAME, np.float32) for c in chunks]

    server = Code2WavServer.sync_init(Code2WavDeploymentConfig(device="cpu", stall_timeout_s=5), CheckpointSource(),
                                      STREAMING)
    server._engine, server._metrics = StuckDecoder(), Code2WavMetrics()
    now = [100.0]
    server._clock = lambda: now[0]
    server.check_health()
    now[0] += 1000  # idle for long: no work pending, healthy
    server.check_health()

    async def scenario():
        call = asyncio.ensure_future(server.decode(CodecChunk("r", 0, np.zeros((2, 16), np.int64), 0)))
        await asyncio.to_thread(server._engine.entered.wait, 30)
        now[0] += 4.9
        server.check_health()  # pending, within the timeout
        now[0] += 0.2
        with pytest.raises(RuntimeError, match="no progress"):
            server.check_health()
        server._engine.release.set()
        await call
        server.check_health()  # the decode finished: healthy again

    loop.run_until_complete(scenario())
    server.__del__()


def test_talker_health_sees_an_engine_that_stopped_stepping(loop, tiny_custom_voice):
    from deployments.talker.server import TalkerServer

    config = TalkerDeploymentConfig(name="fake", model=str(tiny_custom_voice), device="cpu", warmup=False,
                          engine_cls="tests.fake_engine:FakeTalkerEngine",
                          engine_kwargs={"max_num_seqs": 2, "stall_seed": 666, "stall_timeout_s": 0.5})
    server = TalkerServer.sync_init(config, STREAMING)
    loop.run_until_complete(server.start())
    try:
        chunks = loop.run_until_complete(collect(server.generate(request_for(server, 6))))
        assert sum(c.num_new for c in chunks) == 6
        server.check_health()
        # what the autoscaling policy reads of the fake (test_autoscaling's engine): it failed, and the policy
        # silently fell back to Serve's own count, while the fake's stats lacked `parked`
        assert server.record_autoscaling_stats() == {"waiting": 0.0, "running": 0.0, "slots": 2.0}

        async def stuck():
            agen = server.generate(request_for(server, 50, rid="stuck", seed=666))
            task = asyncio.ensure_future(anext(agen))
            while not server._engine.stats().stalled:  # the fault is injected by the request itself
                await asyncio.sleep(0.01)
            for _ in range(1000):  # the heartbeat goes stale once stall_timeout_s passes
                try:
                    server.check_health()
                except RuntimeError as e:
                    # the stuck request's stream ends now, visibly, rather than when Serve's graceful stop of
                    # the replica gives up on it
                    with pytest.raises(APIError) as failed:
                        await asyncio.wait_for(task, 60)
                    assert failed.value.status == 503 and failed.value.code == "replica_failed"
                    return str(e)
                await asyncio.sleep(0.01)
            raise AssertionError("check_health never noticed the stalled engine")

        assert "no step" in loop.run_until_complete(stuck())
        assert server._open == {}  # the ended stream left the replica's books
    finally:
        server.__del__()


@pytest.fixture(scope="module")
def spans():
    """An in-memory exporter on the process's tracer provider (what Serve's `tracing_config` sets in a replica)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    trace.get_tracer_provider().add_span_processor(processor)
    yield exporter
    processor.shutdown()


def test_a_request_traces_the_talkers_admission_and_first_chunk_and_code2wavs_decode(loop, talker, code2wav, spans):
    """Spans of the servers under the caller's (Serve propagates the ingress's context into each call)."""
    from opentelemetry import trace

    from deployments.ingress.request_log import RequestRecord

    spans.clear()
    record = RequestRecord("traced", "speech", 12, True)
    with trace.use_span(record.span, end_on_exit=False):
        chunks = loop.run_until_complete(collect(talker.generate(request_for(talker, 9, rid="traced"))))
        loop.run_until_complete(code2wav.decode_many(chunks[:2]))
    record.first_audio()
    record.end("ok", 200, audio_s=0.72)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    root = by_name["tts.request speech"]
    assert root.parent is None and root.attributes["tts.outcome"] == "ok" and root.attributes["tts.status"] == 200
    assert [e.name for e in root.events] == ["first_audio"]
    for name in ("talker.admission", "talker.first_chunk", "code2wav.decode"):
        span = by_name[name]
        assert span.parent.span_id == root.context.span_id and span.context.trace_id == root.context.trace_id, name
    admission, first = by_name["talker.admission"], by_name["talker.first_chunk"]
    assert admission.end_time <= first.end_time and first.attributes["tts.frames"] == chunks[0].num_new
    decode = by_name["code2wav.decode"]
    assert decode.attributes["tts.chunks"] == 2 and list(decode.attributes["tts.engine_request_ids"]) == ["traced"]


def test_a_failed_request_marks_its_span_as_an_error(spans):
    from opentelemetry.trace import StatusCode

    from deployments.ingress.request_log import RequestRecord

    spans.clear()
    RequestRecord("refused", "speech", 3, False).end("bad_request", 400)
    (span,) = spans.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and span.attributes["tts.status"] == 400
