"""The load generator's metric code on synthetic traces with known answers (no server, no Ray)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from bench.loadgen.client import SAMPLES_PER_FRAME, SpeechSettings, _AudioReader, _SSEReader
from bench.loadgen.metrics import BYTES_PER_SECOND, Stats, continuity, percentile, rebuffering
from bench.loadgen.records import LoadPoint, PointRun, RequestResult
from bench.loadgen.report import build_document, markdown, plot, write_results
from bench.loadgen.runner import SweepConfig, SweepOutcome, poisson_arrivals, run_point, sweep
from bench.loadgen.sentences import Sentence, TextPool, load_sentences
from bench.loadgen.serve_config import bench_config
from bench.loadgen.summary import summarize

# ------------------------------------------------------------------------------------------- percentiles


def test_percentile_interpolates_linearly_between_order_statistics():
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 100
    assert percentile([7.0], 99) == 7.0
    assert percentile([3, 1, 2], 50) == 2  # order of the input does not matter
    assert percentile([10, 20], 25) == pytest.approx(12.5)


def test_percentile_rejects_nothing_and_bad_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_stats_ignore_missing_values_and_summarize_the_rest():
    s = Stats.of([None, *range(1, 101), None])
    assert (s.n, s.mean, s.min, s.max) == (100, 50.5, 1, 100)
    assert (s.p50, s.p90, s.p95, s.p99) == pytest.approx((50.5, 90.1, 95.05, 99.01))
    assert Stats.of([]) == Stats(n=0) and Stats.of([None]).p95 is None


# -------------------------------------------------------------------------------------------- continuity


def test_real_time_arrivals_never_underrun():
    c = continuity([0, 1, 2, 3], [1, 1, 1, 1])  # 1 s of audio each second: the buffer just keeps up
    assert (c.max_deficit_s, c.underrun_events) == (0, 0) and c.continuous()
    r = rebuffering([0, 1, 2, 3], [1, 1, 1, 1])
    assert (r.stalls, r.stall_s) == (0, 0)


def test_faster_than_real_time_is_continuous():
    assert continuity([0, 0.1, 0.2], [1, 1, 1]) == continuity([], [])  # no deficit at all


def test_one_late_chunk_is_one_underrun_of_known_size():
    # 160 ms first chunk at t=0; the next one (2 s) only at t=0.5: the player starved for 0.34 s
    c = continuity([0, 0.5, 1.0], [0.16, 2.0, 2.0])
    assert c.max_deficit_s == pytest.approx(0.34) and c.underrun_events == 1 and not c.continuous()
    r = rebuffering([0, 0.5, 1.0], [0.16, 2.0, 2.0])
    assert r.stalls == 1 and r.stall_s == pytest.approx(0.34) and r.max_stall_s == pytest.approx(0.34)


def test_without_rebuffer_an_early_stall_counts_at_every_later_arrival():
    arrivals, audio = [0, 1, 2, 3], [0.5, 1, 1, 1]
    c = continuity(arrivals, audio)  # deficits 0.5, 0.5, 0.5: the seeds' definition
    assert c.max_deficit_s == pytest.approx(0.5) and c.underrun_events == 3
    r = rebuffering(arrivals, audio)  # a real player stalls once, then keeps up exactly
    assert r.stalls == 1 and r.stall_s == pytest.approx(0.5)


def test_continuity_threshold_is_inclusive():
    c = continuity([0, 0.25], [0.15, 1])  # deficit 0.1 s
    assert c.max_deficit_s == pytest.approx(0.1)
    assert c.continuous(0.1 + 1e-12) and not c.continuous(0.05)


def test_rebuffering_waits_for_the_resume_threshold():
    arrivals, audio = [0, 1, 1.2, 1.4, 3], [0.5, 0.1, 0.1, 0.5, 1]
    r = rebuffering(arrivals, audio, resume_s=0.3)
    # dry at 0.5, resumes at 1.4 once 0.7 s is buffered; dry again at 2.1, resumes at 3
    assert r.stalls == 2 and r.stall_s == pytest.approx(1.8) and r.max_stall_s == pytest.approx(0.9)
    r0 = rebuffering(arrivals, audio, resume_s=0)  # resumes on every arrival: more, shorter stalls
    assert r0.stalls == 4 and r0.stall_s == pytest.approx(1.8) and r0.max_stall_s == pytest.approx(1.1)


def test_a_stream_that_ends_while_rebuffering_resumes_at_its_last_arrival():
    r = rebuffering([0, 1], [0.5, 0.1], resume_s=0.3)
    assert r.stalls == 1 and r.stall_s == pytest.approx(0.5)


def test_traces_are_validated():
    assert rebuffering([], []).stalls == 0
    with pytest.raises(ValueError):
        continuity([0, 1], [1])
    with pytest.raises(ValueError):
        continuity([1, 0], [1, 1])
    with pytest.raises(ValueError):
        rebuffering([0], [1], resume_s=-1)


# ------------------------------------------------------------------------------------------ aggregation


def ok_request(i: int, ttfa: float, e2e: float, arrivals: list[float], pieces_s: list[float]) -> RequestResult:
    r = RequestResult(index=i, text="hello", language="en", scheduled_s=0.0, sent_s=1.0, status=200, done=True)
    r.first_byte_s = r.first_audio_s = 1.0 + ttfa
    r.end_s = 1.0 + e2e
    r.arrival_s = [1.0 + t for t in arrivals]
    r.arrival_bytes = [round(p * BYTES_PER_SECOND) for p in pieces_s]
    r.audio_bytes = sum(r.arrival_bytes)
    return r


def test_summary_of_a_point_with_known_answers():
    results = [
        ok_request(0, 0.1, 1.0, [0.1, 0.6], [1.0, 1.0]),  # continuous
        ok_request(1, 0.2, 2.0, [0.2, 1.0], [0.5, 1.5]),  # 0.3 s underrun
        ok_request(2, 0.3, 3.0, [0.3, 0.4], [1.0, 1.0]),
        RequestResult(index=3, text="x", language="en", sent_s=1.0, status=429, failure="http_429", done=True,
                      end_s=1.01),
        RequestResult(index=4, text="x", language="en", sent_s=1.5, failure="aborted", done=True, end_s=2.0),
        RequestResult(index=5, text="x", language="en"),  # never sent: the budget ended the point
    ]
    run = PointRun(LoadPoint("closed", 4, 6), results, wall_s=3.0, peak_inflight=4, loop_lag_s=[0.001, 0.003])
    s = summarize(run)
    assert (s.ok, s.failed, s.aborted, s.failures) == (3, 1, 2, {"http_429": 1})
    assert s.failure_rate == pytest.approx(0.25)
    assert s.ttfa_ms.p50 == pytest.approx(200) and s.ttfa_ms.max == pytest.approx(300)
    assert s.e2e_ms.mean == pytest.approx(2000)
    assert s.rtf.p50 == pytest.approx(1.0) and s.rtf.min == pytest.approx(0.5) and s.rtf.max == pytest.approx(1.5)
    assert s.audio_s == pytest.approx(6.0) and s.audio_s_per_s == pytest.approx(2.0)
    assert s.requests_per_s == pytest.approx(1.0)
    assert s.max_deficit_s.max == pytest.approx(0.3) and s.continuous_share == pytest.approx(2 / 3)
    assert s.stalls_mean == pytest.approx(1 / 3) and s.stall_free_share == pytest.approx(2 / 3)
    assert s.loop_lag_ms.max == pytest.approx(3)
    json.dumps(s.to_dict())  # serializable


def test_server_timing_stages_are_summarized_with_the_clients_share():
    results = [ok_request(i, ttfa, 1.0, [ttfa], [1.0]) for i, ttfa in enumerate((0.030, 0.050))]
    results[0].server_timing = {"talker": 12.0, "total": 20.0}  # a first chunk the Talker decoded
    results[1].server_timing = {"talker": 30.0, "total": 40.0, "code2wav": 6.0}  # path order, whatever came first
    run = PointRun(LoadPoint("closed", 2, 2), results, wall_s=1.0)
    s = summarize(run)
    assert list(s.server_timing_ms) == ["talker", "code2wav", "total", "client_side"]
    assert s.server_timing_ms["talker"].p50 == pytest.approx(21.0) and s.server_timing_ms["code2wav"].n == 1
    assert s.server_timing_ms["client_side"].min == pytest.approx(10.0)  # TTFA 30 ms - server total 20 ms
    md = markdown(build_document({"settings": {}, "sweep": {"mode": "closed"}},
                                 SweepOutcome([run], [s], None)))
    assert "| level | talker | code2wav | total | client_side |" in md and "| 2 | 21.0 / 29.1 |" in md


def test_report_renders_markdown_json_and_plots(tmp_path):
    runs = []
    for c in (1, 4):
        results = [ok_request(i, 0.05 * c, 1.0 * c, [0.05 * c, 0.5], [1.0, 1.0]) for i in range(4)]
        runs.append(PointRun(LoadPoint("closed", c, 4), results, wall_s=2.0, peak_inflight=c))
    outcome = SweepOutcome(runs, [summarize(r) for r in runs], "failure rate 10% at closed level 4")
    doc = build_document({"label": "synthetic", "settings": {"model": "tts-1"}, "sweep": {"mode": "closed"}}, outcome)
    md = markdown(doc)
    assert "| 1 | 4 / 4 | 0 | 50 / 50 / 50 / 50 |" in md and "Stopped: failure rate 10%" in md
    files = write_results(doc, tmp_path, plots=False)
    assert json.loads((tmp_path / "results.json").read_text())["points"][1]["level"] == 4
    assert len(json.loads((tmp_path / "results.json").read_text())["points"][0]["request_rows"]) == 4
    assert [f.name for f in files] == ["results.json", "results.md"]
    pytest.importorskip("matplotlib")
    assert sorted(p.name for p in plot(doc, tmp_path)) == ["continuity.png", "latency.png", "throughput.png"]


# ------------------------------------------------------------------------------------------- the client


def test_request_body_and_expected_length():
    s = SpeechSettings(max_new_tokens=10, fixed_length=True, extra={"language": "English"})
    body = s.body("Hi.")
    assert body == {"input": "Hi.", "stream": True, "response_format": "pcm", "stream_format": "audio",
                    "model": "tts-1", "voice": "vivian", "max_new_tokens": 10, "suppress_eos": True,
                    "language": "English"}
    assert s.expected_bytes == 10 * SAMPLES_PER_FRAME * 2
    assert SpeechSettings(max_new_tokens=10).expected_bytes is None
    with pytest.raises(ValueError):
        SpeechSettings(fixed_length=True)


def test_wav_header_is_not_audio_even_when_split_across_reads():
    r = RequestResult(index=0, text="", language="en")
    clock = iter([1.0, 2.0, 3.0])
    reader = _AudioReader(r, lambda: next(clock), header_bytes=44)
    reader.feed(b"R" * 30)  # header only: no arrival
    reader.feed(b"R" * 14 + b"\x00" * 100)
    reader.feed(b"\x00" * 50)
    assert r.arrival_s == [1.0, 2.0] and r.arrival_bytes == [100, 50] and r.first_audio_s == 1.0
    assert reader.finish() is None


def test_sse_events_are_arrivals_when_complete():
    import base64

    def event(kind: str, **fields) -> bytes:
        return f"data: {json.dumps({'type': f'speech.audio.{kind}', **fields})}\n\n".encode()

    r = RequestResult(index=0, text="", language="en")
    clock = iter([1.0, 2.0, 3.0, 4.0])
    reader = _SSEReader(r, lambda: next(clock))
    first = event("delta", audio=base64.b64encode(b"\x00" * 64).decode())
    reader.feed(first[:10])          # incomplete: nothing yet
    reader.feed(first[10:] + event("delta", audio=base64.b64encode(b"\x00" * 32).decode())[:5])
    reader.feed(event("delta", audio=base64.b64encode(b"\x00" * 32).decode())[5:] + event("done", finish_reason="length"))
    assert r.arrival_s == [2.0, 3.0] and r.arrival_bytes == [64, 32] and r.finish_reason == "length"
    assert reader.finish() is None

    bad = RequestResult(index=1, text="", language="en")
    reader = _SSEReader(bad, lambda: 0.0)
    reader.feed(event("error", error={"message": "deadline"}))
    assert bad.failure == "stream_error" and bad.error == "deadline"
    cut = _SSEReader(RequestResult(index=2, text="", language="en"), lambda: 0.0)
    assert cut.finish() == "truncated"  # no done event: the stream was cut

    timed = RequestResult(index=3, text="", language="en", sent_s=0.0)
    clock = iter([1.0, 1.25, 1.5, 1.5])
    reader = _SSEReader(timed, lambda: next(clock))
    reader.feed(event("delta", audio=base64.b64encode(b"\x00" * 64).decode()))
    reader.feed(event("timestamps", words=[{"word": "hi", "start": 0.0, "end": 0.1}]))  # 250 ms after its audio
    reader.feed(event("timestamps", words=[], error={"message": "refused"}))
    reader.feed(event("done", finish_reason="eos"))
    assert timed.timestamps_lag_s == [0.25, 0.5] and timed.timestamps_failed == 1
    timed.done, timed.end_s = True, 2.0
    point = summarize(PointRun(LoadPoint("closed", 1, 1), [timed], wall_s=2.0))
    assert point.timestamps_lag_ms.n == 2 and point.timestamps_lag_ms.max == pytest.approx(500)
    assert point.timestamps_failed == 1


# ------------------------------------------------------------------------------------------- load shapes


class FakeClient:
    """Stands in for SpeechClient: every request takes `seconds` and yields one piece of audio."""

    def __init__(self, seconds: float):
        self.seconds, self.inflight, self.peak_inflight = seconds, 0, 0

    def reset_peak(self) -> None:
        self.peak_inflight = self.inflight

    def worker_loop_lag(self) -> list[float]:
        return []

    async def synthesize(self, r: RequestResult, origin: float) -> None:
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        r.sent_s = time.perf_counter() - origin
        try:
            await asyncio.sleep(self.seconds)
            r.status, r.first_audio_s = 200, time.perf_counter() - origin
            r.arrival_s, r.arrival_bytes, r.audio_bytes = [r.first_audio_s], [BYTES_PER_SECOND], BYTES_PER_SECOND
        except asyncio.CancelledError:
            r.failure = "aborted"
            raise
        finally:
            r.end_s, r.done = time.perf_counter() - origin, True
            self.inflight -= 1


def texts(n: int) -> list[Sentence]:
    return [Sentence("en", f"sentence {i}") for i in range(n)]


def test_closed_loop_holds_exactly_c_requests_in_flight():
    run = asyncio.run(run_point(FakeClient(0.02), LoadPoint("closed", 3, 9), texts(9), random.Random(0)))
    assert all(r.ok for r in run.results) and run.peak_inflight == 3
    assert 0.06 <= run.wall_s < 10  # three waves of 20 ms (the ceiling only catches a run that serialized them)


def test_staggered_closed_loop_starts_stream_k_no_earlier_than_k_of_c_of_the_spread():
    # 4 streams spread over 0.2 s, requests of 0.3 s: the first four requests are the four streams' first ones
    run = asyncio.run(run_point(FakeClient(0.3), LoadPoint("closed", 4, 8), texts(8), random.Random(0),
                                stagger_s=0.2))
    assert all(r.ok for r in run.results) and run.peak_inflight == 4
    first = sorted(r.scheduled_s for r in run.results)[:4]
    for k, start in enumerate(first):
        assert start >= k * 0.05 - 1e-3  # a timer never fires early; late is the loaded machine's business
    later = sorted(r.scheduled_s for r in run.results)[4:]
    assert all(b >= a + 0.3 - 1e-3 for a, b in zip(first, later, strict=True))  # each stream's next one follows its own


def test_open_loop_sends_on_schedule_and_the_budget_aborts_the_rest():
    client = FakeClient(0.5)
    deadline = time.perf_counter() + 0.2
    run = asyncio.run(run_point(client, LoadPoint("open", 50, 20), texts(20), random.Random(1), deadline))
    assert run.truncated
    s = summarize(run)
    assert s.ok == 0 and s.failed == 0 and s.aborted == 20  # in flight or not yet due: aborted, not failed
    assert run.peak_inflight > 1  # arrivals did not wait for completions


def test_poisson_arrivals_have_the_asked_rate():
    due = poisson_arrivals(20.0, 4001, random.Random(3))
    assert due[0] == 0 and due == sorted(due)
    assert 4000 / due[-1] == pytest.approx(20.0, rel=0.05)
    assert due == poisson_arrivals(20.0, 4001, random.Random(3))


def test_sweep_stops_at_the_first_level_with_failures():
    class FailsAbove(FakeClient):
        async def synthesize(self, r: RequestResult, origin: float) -> None:
            await super().synthesize(r, origin)
            if self.peak_inflight > 2:
                r.failure = "http_429"

    cfg = SweepConfig(mode="closed", levels=(1, 2, 4, 8), requests=4, warmup=1)
    outcome = asyncio.run(sweep(FailsAbove(0.005), cfg, TextPool(texts(10)).draw))
    assert [s.level for s in outcome.summaries] == [1, 2, 4]
    assert "failure rate" in outcome.stop_reason and outcome.summaries[-1].failures == {"http_429": 4}
    assert SweepConfig(mode="open", levels=(10,), requests=5, requests_per_level=3).requests_at(10) == 30


# --------------------------------------------------------------------------------------- texts, configs


def test_shipped_sentences_and_pool():
    en, zh = load_sentences(language="en"), load_sentences(language="zh")
    assert len(en) >= 150 and len(zh) >= 120 and len(load_sentences()) == len(en) + len(zh)
    assert all(5 <= len(s.text.split()) <= 30 for s in en) and all(8 <= len(s.text) <= 60 for s in zh)
    pool = TextPool(en)
    first = pool.draw(random.Random(0), len(en))
    assert len(set(first)) == len(en)  # a whole pass before any repeat
    assert len(pool.draw(random.Random(0), 5)) == 5


def test_bench_config_points_every_model_at_the_checkpoint():
    import yaml

    from tests.bench import REPO

    base = yaml.safe_load((REPO / "configs" / "high_concurrency.yaml").read_text())
    cfg = bench_config(base, "/ckpt", 8123, ["models.0.engine_kwargs.max_num_seqs=128",
                                              "ingress.request_timeout_s=60"])
    args = cfg["applications"][0]["args"]
    assert all(m["model"] == "/ckpt" for m in args["models"]) and cfg["http_options"]["port"] == 8123
    assert args["models"][0]["engine_kwargs"]["max_num_seqs"] == 128 and args["ingress"]["request_timeout_s"] == 60
    assert cfg["applications"][0]["runtime_env"]["env_vars"]["HF_HUB_OFFLINE"] == "1"
    assert args["ingress"]["allow_suppress_eos"] and "allow_suppress_eos" not in base["applications"][0]["args"]["ingress"]
    assert base["applications"][0]["args"]["models"][0]["model"] != "/ckpt"  # the input is not modified
