"""Word timestamps through the real app and its Aligner deployment (the tiny random aligner): SSE events after the
audio they time and before `done`, the JSON body of `stream: false`, a long input's times continuing across its
pieces, the WebSocket's `timestamps` messages. Random weights place words anywhere: the assertions are about the
words (the text's, in order), the ordering of the events and times inside the audio sent, not where each word is."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile as sf

from bench.long_form import chapter
from deployments.config import LongFormSettings
from stages.aligner.words import split_words
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME

pytestmark = pytest.mark.serve

FRAMES = 8
TEXT = "Hello there, world! It's 3:45 now."
FIXED = {"model": "cv", "voice": "vivian", "max_new_tokens": FRAMES, "suppress_eos": True, "seed": 3}


def _sse(http, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def _check_order(events: list[dict]) -> list[dict]:
    """Each timestamps event times audio already sent; done comes last. -> the timestamps events."""
    sent_s, stamps = 0.0, []
    for e in events:
        if e["type"] == "speech.audio.delta":
            sent_s += len(base64.b64decode(e["audio"])) / 2 / SAMPLE_RATE
        elif e["type"] == "speech.audio.timestamps":
            assert all(0 <= w["start"] <= w["end"] <= sent_s + 1e-3 for w in e["words"]), (e, sent_s)
            stamps.append(e)
    assert events[-1]["type"] == "speech.audio.done" and [e["type"] for e in events].count("speech.audio.done") == 1
    return stamps


def test_ready_counts_the_aligner(http):
    ready = http.get("/ready")
    assert ready.status_code == 200 and ready.json()["deployments"]["Aligner"] is True


def test_sse_sends_the_words_after_the_audio_and_before_done(http):
    events = _sse(http, {**FIXED, "input": TEXT, "response_format": "pcm", "timestamps": "word"})  # SSE implied
    stamps = _check_order(events)
    assert len(stamps) == 1 and [w["word"] for w in stamps[0]["words"]] == split_words(TEXT)
    assert "chars" not in stamps[0] and "error" not in stamps[0]
    last_delta = max(i for i, e in enumerate(events) if e["type"] == "speech.audio.delta")
    assert events.index(stamps[0]) > last_delta


def test_replica_stats_say_where_the_aligners_time_goes(http):
    """`bench.replica_stats` reads each Aligner replica's counters: after a timed request, pieces were prepared and
    timed, and the time per piece and per forward is there."""
    import asyncio

    from ray import serve

    from bench.replica_stats import aligner_summary, every_replica
    from tests.serve.conftest import APP

    _check_order(_sse(http, {**FIXED, "input": TEXT, "response_format": "pcm", "timestamps": "word"}))
    aligners = asyncio.run(every_replica(serve.get_deployment_handle("Aligner", app_name=APP), 1))
    (name, stats), = aligners.items()
    assert stats["replica"] == name
    summary = aligner_summary(stats)
    assert summary["pieces"] >= 1 and summary["forwards"] >= 1 and 1 <= summary["mean_batch"] <= summary["pieces"]
    assert summary["prepare_ms_per_piece"] > 0 and summary["forward_ms"] > 0 and summary["forward_ms_per_audio_s"] > 0
    assert summary["queue_wait_ms_per_piece"] >= 0


def test_a_whole_body_with_timestamps_is_json_with_the_audio_and_its_characters(http):
    r = http.post("/v1/audio/speech", json={**FIXED, "input": TEXT, "response_format": "wav", "stream": False,
                                            "timestamps": "char"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    body = r.json()
    audio, rate = sf.read(io.BytesIO(base64.b64decode(body["audio"])), dtype="int16")
    assert rate == SAMPLE_RATE and audio.size == FRAMES * SAMPLES_PER_FRAME
    assert body["audio_seconds"] == pytest.approx(audio.size / SAMPLE_RATE, abs=1e-3)
    assert [w["word"] for w in body["words"]] == split_words(TEXT)
    assert "".join(c["char"] for c in body["chars"]) == TEXT
    assert all(0 <= c["start"] <= c["end"] <= body["audio_seconds"] for c in body["chars"])
    assert body["usage"]["output_tokens"] == FRAMES and body["finish_reason"] == "length"


def test_a_long_inputs_times_continue_across_its_pieces(http):
    text = chapter(290)  # two pieces in this app (tests/serve/test_long_form.py)
    events = _sse(http, {**FIXED, "input": text, "response_format": "pcm", "stream_format": "sse",
                         "timestamps": "word"})
    stamps = _check_order(events)
    assert len(stamps) == 2
    assert [w["word"] for e in stamps for w in e["words"]] == split_words(text)
    first_piece_s = FRAMES * SAMPLES_PER_FRAME / SAMPLE_RATE
    pause = LongFormSettings().sentence_pause_s
    assert all(w["end"] <= first_piece_s + 1e-3 for w in stamps[0]["words"])
    assert all(w["start"] >= first_piece_s + pause - 1e-3 for w in stamps[1]["words"])


def test_timestamps_refused_where_they_cannot_go(http):
    r = http.post("/v1/audio/speech", json={**FIXED, "input": TEXT, "stream_format": "audio", "timestamps": "word"})
    assert r.status_code == 400 and "timestamps" in r.json()["error"]["message"]
    r = http.post("/v1/audio/speech", json={**FIXED, "input": TEXT, "timestamps": "word", "language": "Japanese"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timestamps"
    r = http.post("/v1/audio/speech", json={**FIXED, "input": TEXT, "timestamps": "phoneme"})
    assert r.status_code == 400


def test_the_same_request_gets_the_same_words_and_times(http):
    body = {**FIXED, "input": TEXT, "response_format": "pcm", "stream": False, "timestamps": "word"}
    first, second = (http.post("/v1/audio/speech", json=body).json() for _ in range(2))
    assert first["words"] == second["words"] and first["audio"] == second["audio"]
    assert np.frombuffer(base64.b64decode(first["audio"]), np.int16).size == FRAMES * SAMPLES_PER_FRAME


# ------------------------------------------------------------------ the WebSocket
def _ws_stamps(client, context_id: str) -> tuple[list[dict], dict]:
    """The context's `timestamps` messages (each checked against the audio received before it) and its `done`."""
    stamps = []
    while True:
        m = client.until(lambda m: m.get("context_id") == context_id and m["type"] in ("timestamps", "done", "error"))
        if m["type"] != "timestamps":
            assert m["type"] == "done", m
            return stamps, m
        received_s = client.pcm(context_id).size / SAMPLE_RATE
        assert all(0 <= w["start"] <= w["end"] <= received_s + 1e-3 for w in m["words"]), (m, received_s)
        stamps.append(m)


def test_a_websocket_context_gets_its_words_before_done(base_url):
    from tests.serve.test_websocket import Client

    client = Client(base_url)
    try:
        assert client.open("w", timestamps="char")["type"] == "opened"
        for piece in ("Hello there, ", "world! ", "It's 3:45 now."):
            client.send(type="append", context_id="w", text=piece)
        client.send(type="end", context_id="w")
        stamps, done = _ws_stamps(client, "w")
    finally:
        client.close()
    assert len(stamps) == 1 and [w["word"] for w in stamps[0]["words"]] == split_words(TEXT)
    assert "".join(c["char"] for c in stamps[0]["chars"]) == TEXT
    assert done["usage"]["output_tokens"] == FRAMES


def test_a_websocket_context_that_rolls_over_times_each_piece_from_the_start_of_its_audio(base_url):
    """`fake` holds ~240 characters a live request (tests/serve/test_websocket.py): two pieces, two messages."""
    from tests.serve.test_websocket import Client

    text = chapter(290)
    client = Client(base_url)
    try:
        client.send(type="open", context_id="r", model="fake", voice="vivian", response_format="pcm", seed=5,
                    timestamps="word")
        assert client.until(lambda m: m.get("context_id") == "r" and m["type"] in ("opened", "error"))["type"] == \
            "opened"
        for word in text.split(" "):
            client.send(type="append", context_id="r", text=word + " ")
        client.send(type="end", context_id="r")
        stamps, done = _ws_stamps(client, "r")
    finally:
        client.close()
    assert len(stamps) == 2 and done["finish_reason"] == "eos"
    assert [w["word"] for e in stamps for w in e["words"]] == split_words(text)
    first_end = max(w["end"] for w in stamps[0]["words"])
    assert all(w["start"] >= first_end for w in stamps[1]["words"])
    assert stamps[1]["words"][-1]["end"] <= done["audio_seconds"] + 1e-3
