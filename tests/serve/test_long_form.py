"""A long input through the real app: split into Talker requests, one response (the `openai` client, raw WAV,
SSE), repeatable with a seed; and bench/long_form.py against it briefly.

`cv` serves max_seq_len 512: a ~280-character chapter is two pieces (docs/serving.md, "Long input"). Each piece
runs `max_new_tokens` frames with `suppress_eos` (random weights never stop by themselves)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

from bench.long_form import chapter
from deployments.config import LongFormSettings
from stages.contract import SAMPLE_RATE, SAMPLES_PER_FRAME

pytestmark = pytest.mark.serve

FRAMES = 8
TEXT = chapter(290)  # five sentences, within the test app's max_input_chars (300)
PIECES = 2
PAUSE = LongFormSettings().sentence_pause_s  # the pieces meet where a sentence ends
SAMPLES = PIECES * FRAMES * SAMPLES_PER_FRAME + round(PAUSE * SAMPLE_RATE)
FIELDS = {"max_new_tokens": FRAMES, "suppress_eos": True, "seed": 99}


def test_a_long_input_is_one_whole_file_of_every_piece_and_repeatable(openai_client):
    def whole():
        r = openai_client.audio.speech.with_raw_response.create(
            model="cv", voice="vivian", input=TEXT, response_format="wav", extra_body={**FIELDS, "stream": False})
        return r.headers, r.content

    headers, data = whole()
    audio, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == SAMPLE_RATE and audio.size == SAMPLES, (audio.size, SAMPLES)
    assert headers["x-usage-output-tokens"] == str(PIECES * FRAMES) and headers["x-finish-reason"] == "length"
    gap = audio[FRAMES * SAMPLES_PER_FRAME:FRAMES * SAMPLES_PER_FRAME + round(PAUSE * SAMPLE_RATE)]
    assert not gap.any()  # the pause between the pieces is silence
    assert whole()[1] == data  # a seeded long request is repeatable: each piece's seed derives from it


def test_a_streamed_long_input_has_one_header_and_sse_one_done(openai_client, http):
    with openai_client.audio.speech.with_streaming_response.create(
            model="cv", voice="vivian", input=TEXT, response_format="wav", extra_body=FIELDS) as r:
        data = r.read()  # a proper end: the stream ends with its terminating chunk
    assert data.count(b"RIFF") == 1 and len(data) == 44 + 2 * SAMPLES

    body = {"model": "cv", "voice": "vivian", "input": TEXT, "response_format": "pcm", "stream_format": "sse",
            **FIELDS}
    with http.stream("POST", "/v1/audio/speech", json=body) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds.count("speech.audio.done") == 1 and kinds[-1] == "speech.audio.done", kinds[-3:]
    assert events[-1]["usage"]["output_tokens"] == PIECES * FRAMES
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert np.frombuffer(pcm, "<i2").size == SAMPLES


def test_the_long_form_bench_streams_a_chapter_and_reports_its_gaps(base_url, tmp_path):
    out = tmp_path / "long_form.json"
    subprocess.run([sys.executable, "-m", "bench.long_form", "--url", base_url, "--chars", "290", "--model", "cv",
                    "--max-new-tokens", str(FRAMES), "--suppress-eos", "--out", str(out)],
                   check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["status"] == 200 and report["complete"] and report["chars"] == len(TEXT)
    assert report["audio_s"] == pytest.approx(SAMPLES / SAMPLE_RATE, abs=1e-3)
    assert report["ttfa_ms"] > 0 and report["wall_s"] > 0 and report["max_boundary_gap_ms"] >= 0


def test_an_input_over_the_limit_names_it(http):
    r = http.post("/v1/audio/speech", json={"model": "cv", "voice": "vivian", "input": "x " * 200})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input" and "limit is 300" in r.text


def test_pieces_are_compared_with_the_models_speaker_encoder(base_url, tiny_base, tmp_path):
    """bench/voice_consistency.py: the long input's audio cut back into its pieces at the pauses, each embedded with
    a Base checkpoint's speaker encoder (random weights here: the mechanism, not a quality number)."""
    from bench.voice_consistency import similarities, speaker_encoder, split_at_pauses

    out = tmp_path / "consistency.json"
    subprocess.run([sys.executable, "-m", "bench.voice_consistency", "--url", base_url, "--encoder", str(tiny_base),
                    "--chars", "290", "--model", "cv", "--max-new-tokens", str(FRAMES), "--suppress-eos",
                    "--out", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert report["pieces"] == PIECES and -1 <= report["similarity_min"] <= report["similarity_mean"] <= 1
    clip = (np.random.default_rng(0).standard_normal(SAMPLE_RATE) * 3000).astype(np.int16)
    pause = np.zeros(round(PAUSE * SAMPLE_RATE), np.int16)
    pieces = split_at_pauses(np.concatenate([clip, pause, clip]), min_pause_s=0.2)
    assert [p.size for p in pieces] == [clip.size, clip.size]
    assert similarities(pieces, speaker_encoder(str(tiny_base)))["similarity_min"] == pytest.approx(1.0, abs=1e-4)
