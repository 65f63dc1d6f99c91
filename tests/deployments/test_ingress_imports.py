"""The CPU ingress stays light: its replica process tokenizes and plans requests without importing transformers
or torch (either costs a replica's first request seconds)."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

from tests.conftest import tiny_model_info

ROOT = Path(__file__).resolve().parents[2]

# what an ingress replica does: import its class, receive a Talker's ModelInfo, plan (tokenize) a request
REPLICA = """
import json, pickle, sys
import deployments.ingress
info = pickle.loads(sys.stdin.buffer.read())
loaded = {m: m in sys.modules for m in ("transformers", "torch")}
from deployments.config import TTSServingArgs
from deployments.ingress.request_builder import build_request, choose_voice
from deployments.ingress.schemas import SpeechRequest
args = TTSServingArgs.model_validate({"models": [{"name": info.name}]})
body = SpeechRequest.model_validate({"input": "Hello there, 42 times!", "voice": "vivian", "instructions": "calm"})
request, _ = build_request(body, info, choose_voice(body, info, lambda name: None), None, args, "r")
live, _ = build_request(body, info, choose_voice(body, info, lambda name: None), None, args, "l", live=True)
print(json.dumps({"loaded": loaded, "after": {m: m in sys.modules for m in ("transformers", "torch")},
                  "text_ids": list(request.prompt.text_ids), "instruct_ids": list(request.prompt.instruct_ids)}))
"""


def test_ingress_tokenizes_without_transformers(tiny_custom_voice):
    info = tiny_model_info("cv", tiny_custom_voice)
    tokenizer = info.tokenizer
    result = subprocess.run([sys.executable, "-c", REPLICA], input=pickle.dumps(info), capture_output=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    out = json.loads(result.stdout.decode().strip().splitlines()[-1])
    # importing the ingress and unpickling a Talker's ModelInfo load neither library
    assert out["loaded"] == {"transformers": False, "torch": False}
    # nor does tokenizing and planning a request, whole or live
    assert out["after"] == {"transformers": False, "torch": False}
    assert out["text_ids"] == list(tokenizer.target_ids("Hello there, 42 times!")[1])
    assert out["instruct_ids"] == list(tokenizer.instruct_ids("calm"))


def test_building_the_app_does_not_import_torch():
    """Serve builds the application in a fresh worker before any replica starts (on `serve run`'s path to ready):
    the builder, the deployment classes and `build_app` itself (which validates every engine's options) run
    without torch."""
    script = ("import sys, yaml, deployments.builder, deployments.talker.server, deployments.code2wav.server\n"
              "args = yaml.safe_load(open('configs/high_concurrency.yaml'))['applications'][0]['args']\n"
              "deployments.builder.build_app(args)\n"
              "print('torch' in sys.modules, 'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert result.stdout.decode().split() == ["False", "False"]


def test_builtin_engine_configs_are_the_engines_own():
    """`build_app` validates the built-in engines' options with their torch-free config modules: the same classes
    the engines declare."""
    from deployments.loading import ENGINE_CONFIGS, import_object

    for engine_path, config_path in ENGINE_CONFIGS.items():
        assert import_object(engine_path).config_cls is import_object(config_path)
