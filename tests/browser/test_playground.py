"""The web playground at `/` in a real headless Chromium: it loads cleanly, plays streamed speech through Web
Audio, plays live text typed into the WebSocket tab, and uploads a voice from a file and from the microphone.

The server is `serve run configs/local_all.yaml` on a fresh home (tests/browser/conftest.py), and the module's first
test checks it as a newcomer runs it, browser or not: every task type answers, from the embedded checkpoints."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import wav_bytes
from tests.serve.test_serve_run import _wav_frames

pytestmark = [pytest.mark.serve, pytest.mark.slow]  # `serve run` and a browser

DOCS = Path(__file__).resolve().parents[2] / "docs"
WAIT_MS = 180_000  # a loaded 2-core CI box; every wait ends on a condition, not at a time


def _samples(page) -> int:
    return page.evaluate("window.playground.scheduledSamples")


def _models_listed(page) -> None:
    page.wait_for_function("document.querySelectorAll('#model option').length === 3", timeout=WAIT_MS)


def test_serve_run_local_all_yaml_serves_every_task_type(served):
    """configs/local_all.yaml, as a newcomer runs it: CustomVoice, Base cloning (an uploaded voice and an inline
    `ref_audio`) and VoiceDesign, each answering audio over HTTP on CPU (short: `max_new_tokens` 4)."""
    url, home = served
    short = {"input": "Hello from every task type.", "max_new_tokens": 4, "suppress_eos": True,
             "response_format": "wav", "stream": False}
    with httpx.Client(base_url=url, timeout=120) as http:
        models = {m["id"]: m["task_type"] for m in http.get("/v1/models").json()["data"]}
        assert models == {"qwen3-tts": "CustomVoice", "qwen3-tts-base": "Base",
                          "qwen3-tts-voicedesign": "VoiceDesign"}

        assert _wav_frames(http.post("/v1/audio/speech", json={"model": "qwen3-tts", "voice": "vivian",
                                                               **short})) == 4

        upload = http.post("/v1/audio/voices", data={"name": "alice", "ref_text": "What the clip says."},
                           files={"audio_sample": ("clip.wav", wav_bytes(2.0, seed=7), "audio/wav")})
        assert upload.status_code == 200, upload.text[:500]
        assert _wav_frames(http.post("/v1/audio/speech", json={"model": "qwen3-tts-base", "voice": "alice",
                                                               **short})) == 4
        assert (home / "voices" / "alice" / "meta.json").exists()  # under the default voices_dir

        clip = "data:audio/wav;base64," + base64.b64encode(wav_bytes(1.5, seed=8)).decode()
        assert _wav_frames(http.post("/v1/audio/speech", json={
            "model": "qwen3-tts-clone", "ref_audio": clip, "ref_text": "Another clip.", **short})) == 4

        assert _wav_frames(http.post("/v1/audio/speech", json={
            "model": "qwen3-tts-voicedesign", "instructions": "A calm, low voice.", **short})) == 4
    for kind in ("custom_voice", "base", "voice_design"):
        assert (home / "embedded" / f"{kind}-17b-tiny" / "config.json").exists()


def test_the_page_loads_without_errors_and_lists_models_and_voices(page, served):
    _models_listed(page)
    models = page.eval_on_selector_all("#model option", "els => els.map(e => e.value)")
    assert models == ["qwen3-tts", "qwen3-tts-base", "qwen3-tts-voicedesign"]
    voices = page.eval_on_selector_all("#voice option", "els => els.map(e => e.value)")
    assert "vivian" in voices
    assert page.evaluate("window.playground.errors") == [] and page.errors == []
    css = httpx.get(served[0] + "/playground/playground.css", timeout=60)
    assert css.status_code == 200 and "text/css" in css.headers["content-type"]


def test_speak_streams_pcm_into_the_audio_graph(page, tmp_path):
    _models_listed(page)
    page.fill("#text", "Hello from the browser test.")
    page.fill("#max-frames", "12")
    page.fill("#seed", "7")
    page.click("#speak")
    # 12 frames x 1920 samples, every one scheduled on the graph, and a first-audio time shown
    page.wait_for_function("window.playground.scheduledSamples >= 12 * 1920", timeout=WAIT_MS)
    page.wait_for_function("document.getElementById('speak-status').textContent.includes('s of audio')",
                           timeout=WAIT_MS)
    assert _samples(page) == 12 * 1920
    assert page.evaluate("window.playground.firstAudioMs") > 0
    assert "first audio in" in page.text_content("#speak-status")
    assert page.errors == []
    # QWEN3_TTS_UPDATE_SCREENSHOT=1 refreshes the README's picture
    update = os.environ.get("QWEN3_TTS_UPDATE_SCREENSHOT") == "1"
    page.screenshot(path=str(DOCS / "playground.png" if update else tmp_path / "playground.png"))


def test_a_whole_file_format_plays_in_the_audio_element(page):
    _models_listed(page)
    page.fill("#max-frames", "6")
    page.select_option("#format", "wav")
    page.click("#speak")
    page.wait_for_function("document.getElementById('speak-status').textContent.startsWith('wav:')",
                           timeout=WAIT_MS)
    assert page.is_visible("#player") and page.errors == []


def test_live_text_plays_as_it_is_typed(page):
    _models_listed(page)
    page.fill("#max-frames", "10")
    page.click("nav .tab[data-tab=live]")
    page.click("#live-start")
    page.wait_for_function("document.getElementById('live-status').textContent.startsWith('open:')", timeout=WAIT_MS)
    page.type("#live-text", "Typed word by word.", delay=20)
    page.click("#live-end")
    page.wait_for_function("window.playground.liveDone === 1", timeout=WAIT_MS)
    # whole frames on the graph, at most max_new_tokens of them: random weights may draw EOS sooner, and where
    # depends on how the typed text reached the Talker (in which pieces: the machine's load decides)
    frames, rest = divmod(_samples(page), 1920)
    assert rest == 0 and 1 <= frames <= 10, frames
    assert page.evaluate("window.playground.firstAudioMs") > 0 and page.errors == []


def test_a_voice_uploads_from_a_file_and_is_offered_for_the_base_model(page, served):
    _models_listed(page)
    page.click("nav .tab[data-tab=voices]")
    page.fill("#voice-name", "browserfile")
    page.fill("#voice-text", "What the clip says.")
    page.set_input_files("#voice-file", files=[{"name": "clip.wav", "mimeType": "audio/wav",
                                                "buffer": wav_bytes(2.0, seed=5)}])
    page.click("#upload")
    page.wait_for_function("window.playground.uploads === 1", timeout=WAIT_MS)
    page.select_option("#model", "qwen3-tts-base")
    # the page refreshes its voice list after an upload (a fetch): wait for the option, not for a fixed time
    page.wait_for_function("[...document.querySelectorAll('#voice option')].some(o => o.value === 'browserfile')",
                           timeout=WAIT_MS)
    listing = httpx.get(served[0] + "/v1/audio/voices", timeout=60).json()
    assert "browserfile" in [v["name"] for v in listing["uploaded_voices"]]
    assert page.errors == []


def test_a_voice_uploads_from_the_microphone(page, served):
    """Chromium's fake microphone: recorded by MediaRecorder (webm), sent as WAV (what the server reads)."""
    _models_listed(page)
    page.click("nav .tab[data-tab=voices]")
    page.fill("#voice-name", "browsermic")
    page.click("#record")
    page.wait_for_function("document.getElementById('voice-status').textContent === 'recording...'", timeout=WAIT_MS)
    # the recording must hold some audio: wait until the recorder has been running for a while by its own clock
    page.wait_for_function("(window.__t0 ??= performance.now()) && performance.now() - window.__t0 > 1500",
                           timeout=WAIT_MS, polling=100)
    page.click("#record")
    page.wait_for_function("document.getElementById('voice-status').textContent.startsWith('recorded')",
                           timeout=WAIT_MS)
    page.click("#upload")
    page.wait_for_function("window.playground.uploads === 1", timeout=WAIT_MS)
    names = [v["name"] for v in httpx.get(served[0] + "/v1/audio/voices", timeout=60).json()["uploaded_voices"]]
    assert "browsermic" in names and page.errors == []


def test_the_api_key_stays_in_page_memory(page):
    _models_listed(page)
    page.fill("#api-key", "sk-not-stored")
    storage = page.evaluate("JSON.stringify([Object.keys(localStorage), Object.keys(sessionStorage), document.cookie])")
    assert json.loads(storage) == [[], [], ""]




def test_word_timestamps_show_under_streamed_and_whole_speech(page):
    """With "Word timestamps" on, streamed PCM comes as SSE (audio plays, the words show as their event arrives) and a
    whole file as JSON (audio element, words): the embedded aligner times every word of the text."""
    _models_listed(page)
    page.fill("#text", "Timed words, one by one.")
    page.fill("#max-frames", "12")
    page.check("#timestamps")
    page.click("#speak")
    page.wait_for_function("document.getElementById('speak-status').textContent.includes('words timed')",
                           timeout=WAIT_MS)
    assert _samples(page) == 12 * 1920
    words = page.evaluate("window.playground.words.map(w => w.word)")
    assert words == ["Timed", "words", "one", "by", "one"]
    assert page.eval_on_selector_all("#words span", "els => els.length") == 5 and page.is_visible("#words")

    page.select_option("#format", "wav")
    page.click("#speak")
    page.wait_for_function("document.getElementById('speak-status').textContent.startsWith('wav:')",
                           timeout=WAIT_MS)
    assert page.evaluate("window.playground.words.length") == 5 and page.is_visible("#player")
    assert page.errors == []
