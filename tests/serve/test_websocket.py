"""`/v1/audio/speech/stream` with a real WebSocket client (the `websockets` library) against the served app.

Each test waits on messages (opened, audio, done, error) or on the Talker engine's own counters (a context
parked waiting for text, a slot freed), never on a timer alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest

from deployments.first_audio_timing import STAGES
from deployments.ingress.schemas import parse_audio_frame
from stages.contract import SAMPLES_PER_FRAME
from tests.serve.conftest import engine_stats, wait_for, wav_bytes

RECV_TIMEOUT_S = 120.0  # a loaded 2-core machine runs the tiny models slowly; every wait is for a message
TEXT = "Hello from the tests, one piece at a time."


@dataclass
class Received:
    """Everything a connection received, by context."""

    audio: dict[str, bytearray] = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    unclaimed: list[dict] = field(default_factory=list)  # received on the way, not yet returned by a wait

    def of(self, context_id: str, kind: str) -> list[dict]:
        return [m for m in self.messages if m.get("context_id") == context_id and m["type"] == kind]


class Client:
    def __init__(self, base_url: str):
        from websockets.sync.client import connect

        self._connection = connect(base_url.replace("http://", "ws://") + "/v1/audio/speech/stream", max_size=None)
        self.ws = self._connection.__enter__()
        self.got = Received()

    def send(self, **message) -> None:
        self.ws.send(json.dumps(message))

    def open(self, context_id: str, **fields) -> dict:
        body = {"model": "cv", "voice": "vivian", "response_format": "pcm", "suppress_eos": True, "seed": 7,
                "max_new_tokens": 8, **fields}
        self.send(type="open", context_id=context_id, **body)
        return self.until(lambda m: m.get("context_id") == context_id and m["type"] in ("opened", "error"))

    def until(self, predicate) -> dict:
        """The first unclaimed JSON message that matches `predicate`, received now or earlier (audio is collected
        on the way); a message is returned once."""
        for message in self.got.unclaimed:
            if predicate(message):
                self.got.unclaimed.remove(message)
                return message
        while True:
            raw = self.ws.recv(timeout=RECV_TIMEOUT_S)
            if isinstance(raw, bytes):
                cid, audio = parse_audio_frame(raw)
                self.got.audio.setdefault(cid, bytearray()).extend(audio)
                continue
            message = json.loads(raw)
            self.got.messages.append(message)
            if predicate(message):
                return message
            self.got.unclaimed.append(message)

    def done(self, context_id: str) -> dict:
        """The context's next unclaimed `done` (or `error`)."""
        return self.until(lambda m: m.get("context_id") == context_id and m["type"] in ("done", "error"))

    def pcm(self, context_id: str) -> np.ndarray:
        return np.frombuffer(bytes(self.got.audio.get(context_id, b"")), dtype=np.int16)

    def close(self) -> None:
        self._connection.__exit__(None, None, None)


@pytest.fixture
def client(base_url):
    c = Client(base_url)
    yield c
    c.close()


def _idle(model: str = "cv") -> bool:
    s = engine_stats(model)
    return s["running"] == s["parked"] == s["held"] == 0 and s["kv_reserved_tokens"] == 0


def _parked(model: str = "cv", n: int = 1) -> bool:
    return engine_stats(model)["parked"] >= n


def test_text_appended_token_by_token_speaks_like_the_whole_text(client):
    """Character-by-character appends give the audio of the same text sent in one piece (same seed): the
    engine tokenizes the pieces as the whole text and holds back what could still merge."""
    assert client.open("whole")["type"] == "opened"
    client.send(type="end", context_id="whole", text=TEXT)
    whole = client.done("whole")
    assert whole["type"] == "done", whole
    assert whole["finish_reason"] == "length" and whole["usage"]["output_tokens"] == 8
    assert whole["usage"]["input_tokens"] > 5 and whole["audio_seconds"] == pytest.approx(0.64)
    _assert_first_audio_stages(whole)

    assert client.open("pieces")["type"] == "opened"
    for ch in TEXT:
        client.send(type="append", context_id="pieces", text=ch)
    client.send(type="end", context_id="pieces")
    pieces = client.done("pieces")
    assert pieces["type"] == "done" and pieces["usage"] == whole["usage"]
    _assert_first_audio_stages(pieces)
    a, b = client.pcm("whole"), client.pcm("pieces")
    assert a.size == b.size == 8 * SAMPLES_PER_FRAME
    # the same codes; the chunks are cut at other frames (a live context's chunk ends where its text does), and a
    # chunk decoded over its left context instead of from its stream's decoder state differs by the chunking error
    # (docs/code2wav.md section 3; larger on this tiny random decoder): 128 of int16's 32,768 is 0.4% of full scale
    diff = np.abs(a.astype(np.int32) - b)
    assert diff.max() <= 128 and diff.mean() < 4, ("piecewise text spoke different audio", diff.max(), diff.mean())


def _assert_first_audio_stages(done: dict) -> None:
    """A context's `done` says where its first audio went, hop by hop from its first text (one machine: every
    stage is a difference of one clock)."""
    stages = done["first_audio_ms"]
    names = list(stages)
    assert set(names) <= set(STAGES), names
    # the text's way in, the engine's wait for a final word and for its prefill, then the Talker's hops, (Code2Wav's,
    # unless the Talker decoded the first chunk), the reply
    assert names[:8] == ["ingress_call", "to_talker_call", "to_talker_text", "talker_text", "talker_queue", "talker",
                         "talker_decode", "to_ingress"]
    assert names[-2:] == ["respond", "total"]
    assert all(ms >= 0 for ms in stages.values()), stages
    assert sum(ms for name, ms in stages.items() if name != "total") == pytest.approx(stages["total"], abs=0.05)


def _open_parked(client, context_id: str, frames: int, text: str) -> None:
    """Open a context, send it `text` and wait until the engine parks it, waiting for more."""
    assert client.open(context_id, max_new_tokens=frames)["type"] == "opened"
    client.send(type="append", context_id=context_id, text=text)
    wait_for(_parked, 120, message="the context parked, waiting for text")


def test_a_context_waits_for_text_and_flush_speaks_what_it_has(client):
    """Without its next text a context parks in the engine (no audio past its text); `flush` releases the held
    last word and closes the utterance, which then plays to its end without `end`."""
    _open_parked(client, "waits", 40, "Hello there")
    client.send(type="flush", context_id="waits")
    done = client.done("waits")
    assert done["type"] == "done" and done["finish_reason"] == "length", done
    assert client.pcm("waits").size == 40 * SAMPLES_PER_FRAME
    wait_for(_idle, 60, message="the slot freed")


def test_cancel_mid_utterance_frees_the_engine_slot(client):
    _open_parked(client, "c1", 200, "Some words, and then")
    client.send(type="cancel", context_id="c1")
    done = client.done("c1")
    assert done["type"] == "done" and done["finish_reason"] == "cancelled", done
    wait_for(_idle, 60, message="the cancelled context's slot and KV freed")
    # its id is free again: a later message for it is an error, a new open works
    client.send(type="append", context_id="c1", text="more")
    assert client.until(lambda m: m["type"] == "error")["error"]["code"] == "context_not_found"


def test_two_contexts_interleave_on_one_socket(client):
    assert client.open("a", max_new_tokens=6, seed=1)["type"] == "opened"
    assert client.open("b", voice="ryan", max_new_tokens=10, seed=2)["type"] == "opened"
    for word in TEXT.split(" "):
        client.send(type="append", context_id="a", text=word + " ")
        client.send(type="append", context_id="b", text=word + " ")
    client.send(type="end", context_id="b")
    client.send(type="end", context_id="a")
    a, b = client.done("a"), client.done("b")
    assert a["type"] == b["type"] == "done", (a, b)
    assert a["usage"]["output_tokens"] == 6 and b["usage"]["output_tokens"] == 10
    assert client.pcm("a").size == 6 * SAMPLES_PER_FRAME and client.pcm("b").size == 10 * SAMPLES_PER_FRAME


def test_bad_messages_are_answered_and_nothing_else_changes(client):
    assert client.open("ok", max_new_tokens=6)["type"] == "opened"
    client.send(type="append", context_id="ok", text="First words of a")
    bad = [
        ("not json", "invalid_json"),
        (json.dumps({"type": "shout", "context_id": "ok"}), "invalid_message"),
        (json.dumps({"type": "append", "context_id": "ok"}), "invalid_message"),  # no text
        (json.dumps({"type": "append", "context_id": "nope", "text": "x"}), "context_not_found"),
        (json.dumps({"type": "open", "context_id": "ok", "voice": "vivian"}), "context_exists"),
        (json.dumps({"type": "open", "context_id": "v", "model": "cv", "voice": "nobody"}), "voice_not_found"),
        (json.dumps({"type": "open", "context_id": "s", "model": "cv", "voice": "vivian", "stream": True}),
         "invalid_message"),
        (json.dumps({"type": "append", "context_id": "ok", "text": "x" * 400}), "input_too_long"),  # limit 300
    ]
    for raw, code in bad:
        client.ws.send(raw)
        error = client.until(lambda m: m["type"] == "error")
        assert error["error"]["code"] == code, (raw, error)
        assert error["final"] is (code == "voice_not_found"), error  # a refused open: that context never was
    client.ws.send(b"\x00binary")
    assert client.until(lambda m: m["type"] == "error")["error"]["code"] == "invalid_message"
    client.send(type="end", context_id="ok", text=" sentence.")
    done = client.done("ok")
    assert done["type"] == "done" and done["usage"]["output_tokens"] == 6
    assert client.pcm("ok").size == 6 * SAMPLES_PER_FRAME


def test_client_disconnect_aborts_everything_it_had_open(base_url):
    c = Client(base_url)
    assert c.open("x", max_new_tokens=200)["type"] == "opened"
    assert c.open("y", max_new_tokens=200, voice="ryan")["type"] == "opened"
    c.send(type="append", context_id="x", text="Waiting for the rest of")
    c.send(type="append", context_id="y", text="Also waiting for")
    wait_for(lambda: _parked(n=2), 120, message="both contexts parked")
    c.close()
    wait_for(_idle, 60, message="the departed client's contexts aborted")


def test_idle_timeout_ends_a_context_whose_text_stops(client):
    # the words come with the open: the short idle clock starts only once the Talker has spoken them and waits
    opened = client.open("slow", max_new_tokens=100, idle_timeout_s=0.5, input="Only these words and")
    assert opened["type"] == "opened"
    error = client.done("slow")
    assert error["type"] == "error" and error["status"] == 408 and error["error"]["code"] == "text_timeout", error
    assert 0 < client.pcm("slow").size < 100 * SAMPLES_PER_FRAME  # what it spoke before it waited was sent
    wait_for(_idle, 60, message="the timed-out context's slot freed")
    assert client.open("next", max_new_tokens=4)["type"] == "opened"  # the socket goes on
    client.send(type="end", context_id="next", text="Next.")
    assert client.done("next")["type"] == "done"


def test_voice_design_and_uploaded_base_voices_and_an_encoded_format(client, http):
    from tests.audio_decode import decode

    clip = wav_bytes(1.5, seed=5)
    r = http.post("/v1/audio/voices", files={"audio_sample": ("a.wav", clip, "audio/wav")},
                  data={"name": "wsvoice", "ref_text": "A reference sentence."})
    assert r.status_code in (200, 201), r.text
    assert client.open("vd", model="vd", voice=None, instructions="A calm, low voice.", max_new_tokens=5,
                       response_format="mp3")["type"] == "opened"
    assert client.open("base", model="base", voice="wsvoice", max_new_tokens=5)["type"] == "opened"
    for cid in ("vd", "base"):
        client.send(type="append", context_id=cid, text="Spoken as it ")
        client.send(type="end", context_id=cid, text="arrives.")
    for cid in ("vd", "base"):
        done = client.done(cid)
        assert done["type"] == "done" and done["usage"]["output_tokens"] == 5, done
    assert client.pcm("base").size == 5 * SAMPLES_PER_FRAME
    audio, rate = decode(bytes(client.got.audio["vd"]), "mp3")
    assert rate == 24000 and abs(audio.shape[0] / rate - 0.4) < 0.06  # 5 frames, within the codec's padding


def test_live_benchmark_measures_an_utterance(base_url):
    """`python -m bench.live`'s level runner against the app: one connection, two short utterances."""
    import asyncio
    import types

    from bench.live import run_level

    args = types.SimpleNamespace(model="cv", voice="vivian", frames=4, word_interval_s=0.01, utterances=2,
                                 pieces="leading-space")
    url = base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    level = asyncio.run(run_level(url, 1, ["Hello there, listener.", "A second short utterance."], args))
    assert level["utterances"] == 2 and level["errors"] == 0, level
    assert level["first_word_to_audio_ms"]["n"] == 2 and level["first_word_to_audio_ms"]["p50"] > 0
    assert level["audio_s_per_s"] > 0 and level["gap_free_share"] is not None
    # where the first audio went: the server's stages from each context's `done`, then the client's rest
    stages = level["first_audio_stages_ms"]
    assert list(stages)[:6] == ["ingress_call", "to_talker_call", "to_talker_text", "talker_text", "talker_queue",
                                "talker"]
    assert list(stages)[-3:] == ["total", "client_side", "open"]
    assert stages["total"]["p50"] <= level["first_word_to_audio_ms"]["max"]
    assert all(st["p50"] is not None and st["p50"] >= 0 for st in stages.values()), stages
    from bench.live import _stages_table

    assert "| 1 | " in _stages_table([level]) and "to_talker_text" in _stages_table([level])
    # spread over worker processes that start together: the same measurements, each worker's loop lag with them
    spread = asyncio.run(run_level(url, 2, ["Hello there, listener."], types.SimpleNamespace(
        **{**vars(args), "pieces": "trailing-space"}, processes=2)))
    assert spread["processes"] == 2 and spread["utterances"] == 4 and spread["errors"] == 0, spread
    assert spread["first_word_to_audio_ms"]["n"] == 4 and spread["client_loop_lag_ms"]["max"] >= 0
    assert list(spread["first_audio_stages_ms"])[-3:] == ["total", "client_side", "open"]



def test_the_replicas_event_loop_lag_is_read_for_a_window(base_url):
    """The ingress's `replica_stats` and the Talker's `engine_stats` carry their event loop's lag (sampled since the
    replica started: deployments/loop_lag.py), which `bench.replica_stats --lag-between` subtracts per replica."""
    from ray import serve

    from bench.replica_stats import lag_between
    from tests.serve.conftest import APP

    def read() -> dict:
        ingress = serve.get_deployment_handle("TTSIngress", app_name=APP).replica_stats.remote().result(timeout_s=30)
        return {"ingress": {ingress["replica"]: ingress["event_loop_lag"]},
                "talker": {"cv": engine_stats("cv")["event_loop_lag"]}}

    first = read()
    # a lag sample per 10 ms of each loop: a second read after a sample more of the Talker's (no clock: its count)
    second = wait_for(lambda: (r := read())["talker"]["cv"]["samples"] > first["talker"]["cv"]["samples"] and r,
                      timeout=60, interval=0.01, message="a new loop sample in the Talker")
    window = lag_between({"event_loop_lag": first}, {"event_loop_lag": second})
    assert len(window["ingress"]) == 1 and window["talker"]["cv"]["samples"] >= 1
    for lag in (*first["ingress"].values(), first["talker"]["cv"]):
        assert lag["samples"] > 0 and len(lag["counts"]) == len(lag["bounds_ms"]) + 1

def _ingress_stats() -> dict:
    from ray import serve

    from tests.serve.conftest import APP

    return serve.get_deployment_handle("TTSIngress", app_name=APP).websocket_stats.remote().result(timeout_s=30)


def test_a_message_of_any_depth_or_size_is_answered_and_the_session_goes_on(client):
    assert client.open("deep", max_new_tokens=6)["type"] == "opened"
    client.send(type="append", context_id="deep", text="Words before the junk,")
    nested = [
        "[" * 100_000,  # unclosed
        "[" * 5_000 + "]" * 5_000,
        '{"a": ' * 5_000 + "1" + "}" * 5_000,
        '{"type": "append", "context_id": "deep", "text": ' + "[" * 5_000 + "]" * 5_000 + "}",
        json.dumps({"type": "append", "context_id": "deep", "text": ["x"] * 200_000}),  # 1 MB, shallow
    ]
    for raw in nested:
        client.ws.send(raw)
        error = client.until(lambda m: m["type"] == "error")
        assert error["error"]["code"] in ("invalid_json", "invalid_message"), error
        assert error["final"] is False and error["status"] == 400, error
    client.send(type="end", context_id="deep", text=" and after it.")
    done = client.done("deep")
    assert done["type"] == "done" and done["usage"]["output_tokens"] == 6, done


def test_every_context_ends_with_done_or_a_final_error(client):
    """`end` without any text: the Talker would refuse it; the ingress ends the context with a final error."""
    assert client.open("empty")["type"] == "opened"
    client.send(type="end", context_id="empty")
    error = client.done("empty")
    assert error["type"] == "error" and error["final"] is True, error
    assert error["status"] == 400 and error["error"]["code"] == "empty_input", error
    wait_for(_idle, 60, message="the ended context's slot freed")
    client.send(type="append", context_id="empty", text="late")  # it has ended: its id is free
    late = client.until(lambda m: m["type"] == "error")
    assert late["error"]["code"] == "context_not_found" and late["final"] is False, late
    assert client.open("empty", max_new_tokens=4)["type"] == "opened"  # the socket goes on
    client.send(type="end", context_id="empty", text="Now with words.")
    assert client.done("empty")["type"] == "done"


def test_closed_sockets_leave_nothing_counted(base_url):
    """N sockets, some with a context waiting for text, closed: the replica's open-socket count returns to 0 and
    every context is aborted."""
    clients = [Client(base_url) for _ in range(6)]
    wait_for(lambda: _ingress_stats()["open_websockets"] >= 6, 60, message="6 sockets counted")
    for i, c in enumerate(clients[:2]):
        assert c.open(f"p{i}", max_new_tokens=200)["type"] == "opened"
        c.send(type="append", context_id=f"p{i}", text="Waiting for the rest of")
    wait_for(lambda: _parked(n=2), 120, message="both contexts parked")
    for c in clients:
        c.close()
    wait_for(lambda: _ingress_stats() == {"open_websockets": 0, "client_addresses": 0}, 60,
             message="the closed sockets uncounted")
    wait_for(_idle, 60, message="their contexts aborted")


def test_a_context_longer_than_one_talker_request_rolls_over_into_one_stream(client):
    """`fake` (tests/fake_engine.py: a frame per character of live text, EOS at its end; max_seq_len 512) holds
    ~240 characters a request: a ~290-character context is two live requests, one stream, one `done`."""
    from bench.long_form import chapter
    from deployments.config import LongFormSettings
    from stages.contract import SAMPLE_RATE

    text = chapter(290)
    runs = []
    for run in ("a", "b"):
        client.send(type="open", context_id=run, model="fake", voice="vivian", response_format="wav", seed=5)
        assert client.until(lambda m, run=run: m.get("context_id") == run
                            and m["type"] in ("opened", "error"))["type"] == "opened"
        for word in text.split(" "):
            client.send(type="append", context_id=run, text=word + " ")
        client.send(type="end", context_id=run)
        done = client.done(run)
        assert done["type"] == "done" and done["finish_reason"] == "eos", done
        runs.append((done, bytes(client.got.audio[run])))
    (done, wav), (_, again) = runs
    frames = len(text) + 1  # a frame per character appended (each word with its space)
    pause = round(LongFormSettings().sentence_pause_s * SAMPLE_RATE)  # the pieces meet where a sentence ends
    assert done["usage"]["output_tokens"] == frames
    assert done["audio_seconds"] == pytest.approx((frames * SAMPLES_PER_FRAME + pause) / SAMPLE_RATE, abs=1e-3)
    assert wav.count(b"RIFF") == 1 and len(wav) == 44 + 2 * (frames * SAMPLES_PER_FRAME + pause)
    # the same pieces and codes again; chunks are cut where the text was when they were (see the first test)
    diff = np.abs(np.frombuffer(wav[44:], np.int16).astype(np.int32) - np.frombuffer(again[44:], np.int16))
    assert len(again) == len(wav) and diff.max() <= 128 and diff.mean() < 4
    wait_for(lambda: _idle("fake"), 30, message="both pieces ended")
