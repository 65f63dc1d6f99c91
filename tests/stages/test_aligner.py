"""stages/aligner without the oracle: input checks, the timestamp repair, 24 kHz input, the checkpoint checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stages.aligner import Aligner
from stages.aligner.random_checkpoint import write_random_aligner
from stages.aligner.timestamps import Word, repair_monotonic, words_from_classes
from stages.aligner.words import split_words
from stages.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def aligner(tmp_path_factory) -> Aligner:
    path = write_random_aligner(tmp_path_factory.mktemp("aligner"), tiny=True, dtype="float32", log=lambda *_: None)
    return Aligner.load(path)


def test_repair_keeps_the_longest_rising_run_and_fills_the_rest():
    assert repair_monotonic([80, 160, 240]) == [80, 160, 240]
    assert repair_monotonic([80, 4000, 160, 240]) == [80, 80, 160, 240]  # one outlier: the nearer neighbour
    assert repair_monotonic([80, 160, 240, 320, 0, 0, 0, 800]) == [80, 160, 240, 320, 440, 560, 680, 800]
    assert repair_monotonic([]) == []
    assert words_from_classes(["a", "b"], [1, 2, 3, 4], 80.0) == [Word("a", 0.08, 0.16), Word("b", 0.24, 0.32)]
    # a tie between rising runs goes to the one that ends first (the official first maximum): 30 stays, 4 follows it
    assert words_from_classes(["a", "b"], [1, 2, 30, 4], 80.0) == [Word("a", 0.08, 0.16), Word("b", 2.4, 2.4)]


def test_words_drop_punctuation_and_split_ideographs():
    assert split_words("Don't stop -- 3.5 km!") == ["Don't", "stop", "35", "km"]
    assert split_words("你好，Qwen3模型") == ["你", "好", "Qwen3", "模", "型"]
    assert split_words("... !!!") == []
    with pytest.raises(ValueError, match="Japanese"):
        split_words("こんにちは", "Japanese")


def test_align_takes_24khz_audio_and_times_every_word(aligner):
    rng = np.random.default_rng(0)
    audio = [0.1 * rng.standard_normal(36_000).astype(np.float32), 0.1 * rng.standard_normal(9_000).astype(np.float32)]
    result = aligner.align(audio, ["One two, three.", "!!!"], sample_rate=24000)
    assert [w.word for w in result[0]] == ["One", "two", "three"]
    assert all(w.start <= w.end for w in result[0])
    assert result[1] == []  # nothing to time: no word survives the split


@pytest.mark.parametrize("audio, error", [
    (np.zeros(100, np.float32), "too short"),
    (np.full(4000, np.nan, np.float32), "NaN"),
    (np.zeros((2, 4000), np.float32), "1-D"),
    (np.zeros(16000 * 401, np.float32), "at most 400 s"),
])
def test_bad_waveforms_are_refused_by_name(aligner, audio, error):
    with pytest.raises(ValueError, match=error):
        aligner.align([audio], ["hello"])


def test_mismatched_batch_is_refused(aligner):
    with pytest.raises(ValueError, match="batch size mismatch"):
        aligner.align([np.zeros(4000, np.float32)], ["a", "b"])


def test_a_tts_checkpoint_is_not_an_aligner(tmp_path):
    path = write_random_aligner(tmp_path / "a", tiny=True, dtype="float32", log=lambda *_: None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["thinker_config"]["model_type"] = "qwen3_asr_thinker"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="forced_aligner"):
        Aligner.load(path)
    (path / "vocab.json").unlink()
    with pytest.raises(CheckpointError, match="vocab.json"):
        Aligner.load(path)


def test_padded_shapes_of_the_graphed_path_time_as_the_plain_forward(tmp_path_factory, aligner):
    """On CUDA both transformers replay CUDA graphs over padded shapes (stages/aligner/graphs.py); on a CPU the same
    padded shapes run eagerly: padding (more prompts, more left positions, more and longer attention blocks) changes
    no real position's logits beyond float rounding, nor any word's time."""
    from stages.aligner.graphs import AlignerGraphs

    padded = Aligner(aligner.model, aligner.tokenizer)
    padded.runners = AlignerGraphs(padded.model, capture=False)
    rng = np.random.default_rng(0)
    texts = ["One two three", "你好，世界", "Hello world again and again", "a b", "x y z"]
    for n in (1, 3, 5):  # 5: 8 prompts, 2-8 blocks of one to several windows
        audio = [(0.1 * rng.standard_normal(int((1 + 2.5 * i) * 24000))).astype(np.float32) for i in range(n)]
        plain, graphed = aligner.prepare(audio, texts[:n], 24000), padded.prepare(audio, texts[:n], 24000)
        a, b = aligner.logits(plain), padded.logits(graphed)
        assert a.shape == b.shape and float((a - b).abs().max()) < 1e-4
        assert padded.align(audio, texts[:n], 24000) == aligner.align(audio, texts[:n], 24000)


def test_the_kernels_path_times_as_the_eager_forward(tmp_path_factory, aligner):
    """On a GPU the aligner replays `ForcedAligner.compile_kernels`: the text decoder on the engines' LayerKernels
    over fused q/k/v and gate/up products, the tower through one layer function. The same functions, uncompiled,
    give the eager logits (fp32) and word times."""
    from stages.aligner.audio_encoder import encoder_layer
    from stages.layers import LayerKernels, attention_inputs, attention_output_and_mlp

    path = write_random_aligner(tmp_path_factory.mktemp("kernels"), tiny=True, dtype="float32", log=lambda *_: None)
    fused = Aligner.load(path)
    fused.model.model.fuse_projections()
    fused.model.model.kernels = LayerKernels(pre=attention_inputs, post=attention_output_and_mlp)
    fused.model.audio_tower.layer_fn = lambda *args: encoder_layer(*args)  # a function other than the default
    rng = np.random.default_rng(1)
    audio = [(0.1 * rng.standard_normal(int((1 + 3 * i) * 24000))).astype(np.float32) for i in range(3)]
    texts = ["One two three", "你好，世界", "Hello world again and again"]
    a, b = aligner.logits(aligner.prepare(audio, texts, 24000)), fused.logits(fused.prepare(audio, texts, 24000))
    assert a.shape == b.shape and float((a - b).abs().max()) < 1e-4
    assert fused.align(audio, texts, 24000) == aligner.align(audio, texts, 24000)


def test_warm_shapes_cover_the_forwards_a_server_makes():
    """`AlignerGraphs.warm` captures ahead what a server's forwards meet: every prompt count up to its batch size,
    every block count its audio makes, and prompts of ~6 s pieces at a full batch and of one long piece alone."""
    from stages.aligner.config import AlignerConfig
    from stages.aligner.graphs import MAX_PROMPT, warm_shapes

    cfg = AlignerConfig.from_dict({"thinker_config": {"model_type": "qwen3_forced_aligner",
                                                      "text_config": {"vocab_size": 152064}}})
    tower, text = warm_shapes(cfg, 32, 480.0)
    assert tower[0] == (128, 104) and tower[-1] == (1, 8) and len(set(tower)) == len(tower) == 6 * 13 + 2
    assert {length for n, length in tower if n > 32} == {104}  # 33+ blocks of 32 pieces: one is a full block
    rows = {r for r, _ in text}
    assert rows == {1, 2, 4, 8, 16, 32}
    assert (32, 256) in text and (1, MAX_PROMPT) in text and (8, MAX_PROMPT) in text
    assert all(r * s <= 32 * 480 for r, s in text if s > MAX_PROMPT // r)
    assert text == sorted(text, reverse=True)  # largest first: the shared buffers are allocated once
    small_tower, small_text = warm_shapes(cfg, 4, 40.0)
    assert max(n for n, _ in small_tower) == 16 and max(r for r, _ in small_text) == 4


def test_the_warm_up_runs_a_forward_of_several_unequal_pieces(aligner):
    """A batch of several rows of unequal lengths lays out the eager front end's tensors differently from one row
    (the spectrogram of a zero-padded batch, windows of several lengths); a kernel built or chosen for a layout the
    first time it is met is met in the warm-up, not in a request's wait. Within the server's bounds only."""
    aligner.spectrogram_shapes.clear()
    aligner.model.audio_tower.conv_shapes.clear()
    aligner.warm_up(8, 60.0)
    rows = sorted(n for n, _ in aligner.spectrogram_shapes)
    assert rows[0] == 1 and rows[-1] >= 3
    assert max(windows for windows, _ in aligner.model.audio_tower.conv_shapes) > 1  # several windows in one batch
    aligner.spectrogram_shapes.clear()
    aligner.warm_up(1, 60.0)  # a server that forwards one piece at a time makes no multi-piece forward
    assert {n for n, _ in aligner.spectrogram_shapes} == {1}
