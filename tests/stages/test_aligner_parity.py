"""Parity of stages/aligner with the official Qwen3-ForcedAligner (qwen-asr 0.0.6) on tiny random checkpoints (fp32).

Each batch runs through the official `Qwen3ForcedAligner.align` in its own venv and through ours: identical prompts
(input ids, left padding), timestamp logits within fp32 rounding at every real position, identical words and times.
The batches cover English with punctuation, numbers and apostrophes, Chinese, mixed Chinese/English, waveforms
shorter than one convolution window, exactly one window, and several attention blocks, alone and batched together.
Two checkpoints: the one our writer makes, and one whose weights the official classes made and saved.

The audio tower's attention is blocked (`n_window_infer`), as the official flash-attention and vLLM paths compute it;
the official eager/SDPA path forgets its block mask and attends across blocks, so the oracle runs with that mask
applied (tests/oracle/official_aligner.py); without it, it agrees wherever a waveform fits in one block.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from stages.aligner import Aligner
from stages.aligner.random_checkpoint import aligner_config, write_random_aligner
from tests.oracle.aligner_venv import run_asr_oracle

pytestmark = pytest.mark.oracle

ENGLISH = "Hello, world! It's 3:45 pm -- we've got 1,234 items (roughly 12.5%) left."
CHINESE = "今天天气很好，我们去公园散步吧。"
MIXED = "我昨天买了iPhone 15 Pro，花了7999元！OK吗？"
# 16 kHz samples: below one 100-frame window, exactly one window, several windows and attention blocks
LENGTHS = {"short": 7_777, "one_window": 16_000, "long": 83_333}
BATCHES = {
    "english_alone": [("long", ENGLISH, "English")],
    "chinese_alone": [("short", CHINESE, "Chinese")],
    "mixed_batch": [("long", ENGLISH, "English"), ("short", CHINESE, "Chinese"), ("one_window", MIXED, "Chinese")],
    "same_length_batch": [("one_window", MIXED, "Chinese"), ("one_window", ENGLISH, "english")],
}


def _waveform(samples: int, seed: int) -> np.ndarray:
    """A voice-like test signal: a few harmonics of a gliding pitch under a syllable-rate envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / 16000
    pitch = 120 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 16000
    voice = sum(np.sin(k * phase) / k for k in range(1, 6)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) ** 2
    return (0.3 * voice + 0.01 * rng.standard_normal(samples)).astype(np.float32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("aligner_ckpt")
    ours = write_random_aligner(root / "ours", tiny=True, dtype="float32", seed=3, log=lambda *_: None)
    official = root / "official"
    (root / "config.json").write_text(json.dumps(aligner_config(tiny=True)))
    run_asr_oracle("official_aligner.py", "write", str(root / "config.json"), str(official), "5")
    # official save_pretrained writes a config.json it cannot re-read (the thinker's model_type becomes the ASR one):
    # the layout's config and the processor files are ours, the weights the official classes'
    for name in ("config.json", "preprocessor_config.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(ours / name, official / name)
    return {"ours": ours, "official": official}


@pytest.fixture(scope="module")
def waveforms(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("aligner_wav")
    paths = {}
    for i, (name, n) in enumerate(LENGTHS.items()):
        paths[name] = root / f"{name}.npy"
        np.save(paths[name], _waveform(n, seed=i))
    return paths


@pytest.fixture(scope="module", params=["ours", "official"])
def case(request, checkpoints, waveforms, tmp_path_factory):
    ckpt = checkpoints[request.param]
    out = tmp_path_factory.mktemp(f"official_{request.param}")
    batches = [{"name": name, "audios": [str(waveforms[w]) for w, _, _ in items], "texts": [t for _, t, _ in items],
                "languages": [lang for _, _, lang in items]} for name, items in BATCHES.items()]
    official = {}
    for mode, block_attention in (("blocked", True), ("unpatched", False)):
        spec = {"checkpoint": str(ckpt), "block_attention": block_attention, "batches": batches}
        (out / f"{mode}.json").write_text(json.dumps(spec))
        run_asr_oracle("official_aligner.py", "align", str(out / f"{mode}.json"), str(out / mode))
        official[mode] = {name: torch.load(out / mode / f"{name}.pt") for name in BATCHES}
    return Aligner.load(ckpt, dtype="float32"), official, waveforms


@pytest.mark.parametrize("batch", list(BATCHES))
def test_words_and_logits_match_the_official_aligner(case, batch):
    aligner, official, waveforms = case
    items = BATCHES[batch]
    expected = official["blocked"][batch]
    prepared = aligner.prepare([np.load(waveforms[w]) for w, _, _ in items], [t for _, t, _ in items],
                               languages=[lang for _, _, lang in items])
    assert torch.equal(prepared.input_ids.cpu(), expected["input_ids"])
    assert torch.equal(prepared.attention_mask.cpu(), expected["attention_mask"])
    logits = aligner.logits(prepared).float().cpu()
    real = expected["attention_mask"].bool()
    torch.testing.assert_close(logits[real], expected["logits"][real], rtol=0, atol=1e-4)
    words = aligner.words(prepared, logits.argmax(-1))
    assert [[(w.word, w.start, w.end) for w in row] for row in words] == [
        [tuple(w) for w in row] for row in expected["words"]]
    # the head's classes vary over the slots: the comparison says something about the path to them
    slots = prepared.input_ids.cpu() == aligner.config.timestamp_token_id
    assert len(set(logits.argmax(-1)[slots].tolist())) > 1


@pytest.mark.parametrize("batch", ["chinese_alone", "same_length_batch"])
def test_within_one_attention_block_the_unpatched_official_path_agrees(case, batch):
    _, official, _ = case
    blocked, unpatched = official["blocked"][batch], official["unpatched"][batch]
    assert blocked["words"] == unpatched["words"]
    real = blocked["attention_mask"].bool()
    torch.testing.assert_close(blocked["logits"][real], unpatched["logits"][real], rtol=0, atol=1e-4)


def test_words_are_split_as_the_official_processor_splits_them(case):
    _, official, _ = case
    words = [[w[0] for w in row] for row in official["blocked"]["mixed_batch"]["words"]]
    assert words[0] == ["Hello", "world", "It's", "345", "pm", "we've", "got", "1234", "items", "roughly", "125",
                        "left"]
    assert words[1] == list("今天天气很好我们去公园散步吧")
    assert words[2] == ["我", "昨", "天", "买", "了", "iPhone", "15", "Pro", "花", "了", "7999", "元", "OK", "吗"]
