"""The playground against a server with API keys (`QWEN3_TTS_API_KEYS_FILE`): the page itself is open, nothing
else answers without a key; with the key typed into its field it lists models, speaks over HTTP (Bearer) and
over the WebSocket (`?api_key=`), and the key never reaches the server's logs. The server's checkpoint is a local
directory in the Hugging Face layout named by the environment (the README's `QWEN3_TTS_MODEL=...` path; a 0.6B)."""

from __future__ import annotations

import pytest

from tests.browser.test_playground import WAIT_MS, _samples
from tests.procs import serve_run

pytestmark = [pytest.mark.serve, pytest.mark.slow]  # `serve run` and a browser

KEY = "sk-browser-test-key"


@pytest.fixture(scope="module")
def served(browser, tiny_custom_voice_06, tmp_path_factory):  # overrides conftest's: configs/local.yaml, keys file
    home = tmp_path_factory.mktemp("serve-keys")
    keys = home / "keys.txt"
    keys.write_text(f"{KEY} speech,voices\n")
    env = {"QWEN3_TTS_API_KEYS_FILE": str(keys), "QWEN3_TTS_MODEL": str(tiny_custom_voice_06)}
    with serve_run("local.yaml", home, env=env) as (url, serve_home, log):
        yield url, serve_home, log


def test_the_page_speaks_with_the_key_it_was_given(page, served):
    page.wait_for_function("document.getElementById('speak-status').textContent.includes('cannot list models')",
                           timeout=WAIT_MS)  # no key yet: a 401, said on the page
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.querySelectorAll('#model option').length === 1", timeout=WAIT_MS)
    page.fill("#max-frames", "8")
    page.click("#speak")
    page.wait_for_function("window.playground.scheduledSamples >= 8 * 1920", timeout=WAIT_MS)
    page.click("nav .tab[data-tab=live]")
    page.click("#live-start")
    page.wait_for_function("document.getElementById('live-status').textContent.startsWith('open:')", timeout=WAIT_MS)
    page.type("#live-text", "Typed with a key.", delay=20)
    page.click("#live-end")
    page.wait_for_function("window.playground.liveDone === 1", timeout=WAIT_MS)
    # both utterances' frames on the graph: the spoken 8, and 1-8 typed (random weights may draw EOS sooner, and
    # where depends on the pieces the typed text reached the Talker in: the machine's load decides)
    frames, rest = divmod(_samples(page), 1920)
    assert rest == 0 and 8 + 1 <= frames <= 16, frames
    assert page.evaluate("window.playground.errors") == []
    assert [e for e in page.errors if "401" not in e] == []  # the listing before the key was refused
    logs = "".join(p.read_text(errors="replace") for p in (served[1]).rglob("*.log"))
    logs += served[2].read_text(errors="replace")
    assert KEY not in logs
