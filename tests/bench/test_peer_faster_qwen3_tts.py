"""bench.peer_faster_qwen3_tts on CPU: the CUDA check, the RoPE registry shim, and (where faster-qwen3-tts and
qwen-tts-hf are importable, which CI's environment is not) the peer loading our tiny random checkpoint and
generating exactly N frames with its CUDA graphs replaced by the same calls made eagerly."""

from __future__ import annotations

import types

import pytest
import torch

from bench import peer_faster_qwen3_tts as peer


def test_without_cuda_it_stops_before_importing_the_peer(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="CUDA-only"):
        peer.main(["--checkpoint", str(tmp_path), "--frames", "2", "--runs", "1"])


def test_rope_shim_falls_back_to_rope_parameters(monkeypatch):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def qwen_default(config, device=None, seq_len=None, layer_type=None):  # qwen_tts's: reads config.rope_theta
        return torch.full((config.head_dim // 2,), float(config.rope_theta)), 1.0

    qwen_default.__module__ = "qwen_tts._transformers_compat"
    monkeypatch.setitem(ROPE_INIT_FUNCTIONS, "default", qwen_default)
    assert peer.patch_rope_registry()
    fn = ROPE_INIT_FUNCTIONS["default"]
    assert fn is not qwen_default and peer.patch_rope_registry() == []  # not wrapped twice
    old = types.SimpleNamespace(rope_theta=7.0, head_dim=8)
    assert torch.equal(fn(old)[0], torch.full((4,), 7.0))  # configs with the attribute: qwen_tts's own function
    new = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10000}, head_dim=16,
                                hidden_size=32, num_attention_heads=2)
    inv_freq, scale = fn(new)
    torch.testing.assert_close(inv_freq, 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))
    assert scale == 1.0


def _cpu_peer(checkpoint, monkeypatch, max_seq_len=256):
    """FasterQwen3TTS as from_pretrained builds it (same classes, same arguments), on CPU in fp32, each graph's
    replay the captured function called eagerly and torch.cuda.synchronize a no-op."""
    pytest.importorskip("faster_qwen3_tts")
    peer.stub_torchaudio_if_broken()  # as the script does (no CPU torchaudio wheel), before qwen_tts imports it
    pytest.importorskip("qwen_tts")
    faster_qwen3_tts, _ = peer.import_peer()
    from faster_qwen3_tts.predictor_graph import PredictorGraph
    from faster_qwen3_tts.talker_graph import TalkerGraph
    from qwen_tts import Qwen3TTSModel

    def eager(step):
        def capture(self, *_a, **_k):
            self._init_cache_layers()
            self._build_attention_masks()
            self.graph, self.captured = types.SimpleNamespace(replay=getattr(self, step)), True
        return capture

    monkeypatch.setattr(PredictorGraph, "capture", eager("_full_loop"))
    monkeypatch.setattr(TalkerGraph, "capture", eager("_decode_step"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    dev, dtype = "cpu:0", torch.float32  # an explicit index: the graph classes ask CUDA for one otherwise
    base = Qwen3TTSModel.from_pretrained(str(checkpoint), device_map="cpu", dtype=dtype, attn_implementation="sdpa")
    talker, cfg = base.model.talker, base.model.config.talker_config
    pg = PredictorGraph(talker.code_predictor, talker.code_predictor.model.config, cfg.hidden_size, device=dev,
                        dtype=dtype, do_sample=True, top_k=50, temperature=0.9)
    tg = TalkerGraph(talker.model, cfg, device=dev, dtype=dtype, max_seq_len=max_seq_len)
    model = faster_qwen3_tts.FasterQwen3TTS(base, pg, tg, device=dev, dtype=dtype, max_seq_len=max_seq_len)
    model.warmup(prefill_len=20)
    return model, int(cfg.codec_eos_token_id)


def test_peer_generates_exactly_n_frames_of_our_checkpoint(tiny_custom_voice, monkeypatch):
    model, eos = _cpu_peer(tiny_custom_voice, monkeypatch)
    speaker = peer.first_speaker(tiny_custom_voice)
    for n in (2, 3):
        row = peer.run_once(model, peer.text_default(), speaker, "English", n, eos)
        peer.check_run(row, n)
        assert row["audio_samples"] == n * 1920 and row["sample_rate"] == 24000
        assert row["ms_per_frame"] > 0 and row["step_ms_p50"] is not None  # n - 1 step intervals
    assert "run" not in vars(model.predictor_graph)  # the recorder detached


def test_min_new_tokens_is_what_holds_eos_off(tiny_custom_voice, monkeypatch):
    model, eos = _cpu_peer(tiny_custom_voice, monkeypatch)
    talker = model.model.model.talker
    head = talker.codec_head

    class EosFirst(torch.nn.Module):  # a model that wants to stop at once
        def forward(self, x):
            logits = head(x)
            logits[..., eos] += 1e4
            return logits

    monkeypatch.setattr(talker, "codec_head", EosFirst())
    speaker = peer.first_speaker(tiny_custom_voice)
    stopped = peer.run_once(model, peer.text_default(), speaker, "English", 6, eos, min_new_tokens=2)
    assert stopped["frames"] == 2  # the peer's default floor, then EOS
    with pytest.raises(RuntimeError, match="expected exactly 6"):
        peer.check_run(stopped, 6)
    held = peer.run_once(model, peer.text_default(), speaker, "English", 6, eos)
    peer.check_run(held, 6)
