"""The first audio's stages from the stamps of each hop, and the Server-Timing header they make."""

from __future__ import annotations

import pytest

from deployments.first_audio_timing import STAGES, FirstAudioTiming, parse_server_timing


def full_timing() -> FirstAudioTiming:
    return FirstAudioTiming(arrived=100.0, talker_called=100.001,
                            talker={"started": 100.003, "queued": 100.0031, "prefilled": 100.005, "cut": 100.013,
                                    "left": 100.0135},
                            chunk_received=100.0145, code2wav=(100.016, 100.020, 100.025), decoded_received=100.026,
                            responded=100.0265)


def test_every_hop_is_the_difference_of_its_stamps():
    stages = full_timing().stages_ms()
    expected = {"ingress": 1, "to_talker": 2, "talker_queue": 2, "talker": 8, "talker_decode": 0.5, "to_ingress": 1,
                "to_code2wav": 1.5,
                "code2wav_queue": 4,
                "code2wav": 5, "from_code2wav": 1, "respond": 0.5, "total": 26.5}
    assert list(stages) == list(expected)  # path order
    assert stages == pytest.approx(expected, abs=1e-6)
    assert sum(v for k, v in stages.items() if k != "total") == pytest.approx(stages["total"])
    assert set(stages) <= set(STAGES)


def test_unread_talker_chunks_merge_its_hops():
    timing = full_timing()
    timing.talker = {}  # object_ref transport: the ingress forwarded a ref
    stages = timing.stages_ms()
    assert "to_talker" not in stages and stages["talker_and_back"] == pytest.approx(13.5)
    assert stages["to_code2wav"] == pytest.approx(1.5)


def test_a_first_chunk_decoded_by_the_talker_has_no_code2wav_stages():
    timing = full_timing()
    timing.code2wav = ()
    timing.decoded_received = timing.chunk_received
    stages = timing.stages_ms()
    assert list(stages) == ["ingress", "to_talker", "talker_queue", "talker", "talker_decode", "to_ingress", "respond",
                            "total"]
    assert stages["respond"] == pytest.approx(12.0)


def test_a_missing_stamp_ends_the_known_stages():
    timing = FirstAudioTiming(arrived=5.0, talker_called=5.002)
    assert timing.stages_ms() == pytest.approx({"ingress": 2.0})


def test_the_header_round_trips():
    timing = full_timing()
    header = timing.header()
    assert header.startswith("ingress;dur=1.00, to_talker;dur=2.00")
    assert parse_server_timing(header) == pytest.approx(timing.stages_ms(), abs=0.01)


def test_parsing_takes_durations_only():
    assert parse_server_timing('cache;desc="hit", db;dur=53.2, app;dur=x, total;desc=t;dur=7') == {"db": 53.2,
                                                                                                 "total": 7.0}
    assert parse_server_timing("") == {}


def test_a_live_contexts_first_audio_runs_from_its_first_text():
    """The live request started before its text (admission and prefill are not its first audio's), so its stages
    start at the first text's arrival: its way to the engine, then the request's hops from the Talker on."""
    timing = FirstAudioTiming(arrived=0.0, live=True, talker_called=99.0)  # the request started at the open
    timing.arrived = 100.0  # the first text
    timing.talker = {"started": 99.001, "cut": 100.150, "left": 100.151, "text_in": 100.020}
    timing.chunk_received, timing.decoded_received = 100.152, 100.160
    timing.code2wav = (100.154, 100.155, 100.159)
    timing.responded = 100.1605
    stages = timing.stages_ms()
    expected = {"ingress_call": 0, "to_talker_call": 0, "to_talker_text": 20, "talker": 130, "talker_decode": 1,
                "to_ingress": 1, "to_code2wav": 2, "code2wav_queue": 1, "code2wav": 4, "from_code2wav": 1, "respond": 0.5,
                "total": 160.5}
    assert list(stages) == list(expected) and stages == pytest.approx(expected, abs=1e-6)
    assert set(stages) <= set(STAGES)
    # a burst: the request's call started in the Talker 30 ms after its first text reached the ingress
    timing.talker = {"started": 100.030, "cut": 100.150, "left": 100.151, "text_in": 100.040}
    late = timing.stages_ms()
    assert late["ingress_call"] == 0 and late["to_talker_call"] == pytest.approx(30)
    assert late["to_talker_text"] == pytest.approx(10)
    assert sum(v for k, v in late.items() if k != "total") == pytest.approx(late["total"])
    # the ingress itself made the call 12 ms after the text came (its loop busy with other opens), 18 ms to start
    timing.talker_called = 100.012
    later = timing.stages_ms()
    assert later["ingress_call"] == pytest.approx(12) and later["to_talker_call"] == pytest.approx(18)
    assert sum(v for k, v in later.items() if k != "total") == pytest.approx(later["total"])
    timing.talker_called = 99.0
    del timing.talker["text_in"]  # no text stamp (the text came before the pump knew the request)
    assert list(timing.stages_ms())[:2] == ["talker", "talker_decode"]
    assert timing.stages_ms()["talker"] == pytest.approx(150)


def test_the_engines_stamps_split_the_talker_stage():
    """The engine's "queued" and "prefilled": a request's wait for its prefill (`talker_queue`) apart from its first
    chunk's frames (`talker`); a live one's wait for the text that makes its first prefill's text final
    (`talker_text`) before. Stamps missing or out of order (another engine; a request queued before its first text
    came) leave `talker` whole."""
    timing = full_timing()
    del timing.talker["prefilled"]
    assert "talker_queue" not in timing.stages_ms() and timing.stages_ms()["talker"] == pytest.approx(10)
    timing = full_timing()
    timing.talker["prefilled"] = 100.002  # before its call started there: not this request's
    assert "talker_queue" not in timing.stages_ms() and timing.stages_ms()["talker"] == pytest.approx(10)
    live = FirstAudioTiming(arrived=100.0, live=True, talker_called=99.0, chunk_received=100.152, responded=100.16)
    live.decoded_received = 100.152
    live.talker = {"started": 99.001, "text_in": 100.020, "queued": 100.120, "prefilled": 100.125, "cut": 100.150,
                   "left": 100.151}
    stages = live.stages_ms()
    assert list(stages)[:6] == ["ingress_call", "to_talker_call", "to_talker_text", "talker_text", "talker_queue",
                                "talker"]
    assert [stages[k] for k in ("to_talker_text", "talker_text", "talker_queue", "talker")] == pytest.approx(
        [20, 100, 5, 25])
    assert sum(v for k, v in stages.items() if k != "total") == pytest.approx(stages["total"])
    live.talker["queued"] = 100.010  # queued before its first text reached the engine (text came with the open)
    stages = live.stages_ms()
    assert "talker_text" not in stages and "talker_queue" not in stages and stages["talker"] == pytest.approx(130)
