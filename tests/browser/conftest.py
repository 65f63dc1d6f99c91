"""A real headless Chromium (Debian's `chromium` package) driven by Playwright against `serve run` of a shipped
config. Playwright's own browser downloads are never used: the browser is the system's. Without a chromium binary
(or the `playwright` package) every test here is skipped, saying why; `.ci/run` installs both.

QWEN3_TTS_CHROMIUM names the browser binary when it is not `chromium` / `chromium-browser` on PATH.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.procs import serve_run


def chromium_binary() -> str | None:
    explicit = os.environ.get("QWEN3_TTS_CHROMIUM")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return next((path for name in ("chromium", "chromium-browser") if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def browser():
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no chromium binary (apt-get install -y chromium, or set QWEN3_TTS_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    with sync_api.sync_playwright() as playwright:
        # a fake microphone (a tone) granted without a prompt; audio may start without a gesture in tests
        browser = playwright.chromium.launch(executable_path=binary, headless=True, args=[
            "--no-sandbox", "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
            "--autoplay-policy=no-user-gesture-required"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")  # its own Ray cluster: stopped before the next module's tests start
def served(tmp_path_factory):
    """`serve run configs/local_all.yaml` as a newcomer runs it: a fresh home, no checkpoint configured, so each
    replica writes its embedded tiny checkpoint -> (base URL, home). Not tied to the browser: the module's checks of
    the server itself run without one (the README's `QWEN3_TTS_MODEL=...` path: tests/browser/test_playground_keys.py)."""
    with serve_run("local_all.yaml", tmp_path_factory.mktemp("serve"), ready_timeout_s=420) as (url, home, _):
        yield url, home


@pytest.fixture
def page(browser, served):  # the browser first: without one, no server is started for the page
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.errors = errors
    page.goto(served[0] + "/")
    yield page
    context.close()
