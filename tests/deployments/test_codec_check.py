"""An ingress replica refuses to start without PyAV or an encoder its formats need, naming what is missing (a
replica started anyway answered every encoded format with a 500 or a cut stream)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deployments.audio import encoders
from deployments.audio.formats import FORMATS, AudioFormat


def test_every_format_has_its_encoder_here():
    encoders.check_codecs()


def test_a_missing_encoder_is_named(monkeypatch):
    monkeypatch.setitem(FORMATS, "nope", AudioFormat("audio/x-nope", "nope", "no_such_encoder"))
    with pytest.raises(RuntimeError, match=r"lacks the encoders of nope \(no_such_encoder\)"):
        encoders.check_codecs()


def test_without_pyav_the_check_says_so():
    """A fresh interpreter where `import av` fails, as on a machine without the package."""
    code = ("import sys; sys.modules['av'] = None\n"
            "from deployments.audio.encoders import check_codecs\n"
            "try:\n    check_codecs()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "PyAV (`pip install av`) is required" in out.stdout, out.stdout + out.stderr
