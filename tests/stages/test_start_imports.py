"""A GPU replica's start imports only what its checkpoint needs: transformers (~10 s to import on the GPU node,
measured by bench/startup.py) only for a Base checkpoint's reference encoder (Mimi)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOAD = """
import json, sys
from stages.qwen3_tts import Qwen3TTS
imported = "transformers" in sys.modules
model = Qwen3TTS.load(sys.argv[1], device="cpu", dtype="float32", talker=True, decoder=True, voice=True)
print(json.dumps({"on_import": imported, "after_load": "transformers" in sys.modules,
                  "reference_encoder": model.reference_encoder is not None}))
"""


def _load(checkpoint: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", LOAD, str(checkpoint)], capture_output=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return json.loads(result.stdout.decode().strip().splitlines()[-1])


def test_custom_voice_start_does_not_import_transformers(tiny_custom_voice):
    assert _load(tiny_custom_voice) == {"on_import": False, "after_load": False, "reference_encoder": False}


def test_base_start_imports_transformers_for_its_reference_encoder(tiny_base):
    assert _load(tiny_base) == {"on_import": False, "after_load": True, "reference_encoder": True}
