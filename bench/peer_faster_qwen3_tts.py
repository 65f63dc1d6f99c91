"""faster-qwen3-tts (the peer of issue 12) timed on our checkpoint: ms per frame at batch 1.

    python -m bench.peer_faster_qwen3_tts --checkpoint DIR --frames 200 --runs 5 --json OUT.json

Why: issue 12 compares our Talker's batch-1 frame time (`python -m bench.talker`) with faster-qwen3-tts, a public
single-stream Qwen3-TTS inference library built on CUDA graphs. Both must run on the same random-weight checkpoint
(`python -m stages.checkpoint random DIR --size 1.7b --kind custom_voice`, the exact Hugging Face layout) in the
same device call; no real weights can be downloaded. `bash bench/gpu_frame_speed.sh peer talker_profile` does that
on the GPU machine.

What is loaded: faster-qwen3-tts through its public API, in its default configuration, the one its README
recommends: `FasterQwen3TTS.from_pretrained(DIR)` (torch backend, bf16, SDPA, static KV cache of `max_seq_len`
2048, the talker's one-token step and the code predictor's 15-codebook loop each captured as one CUDA graph),
then `warmup()` (captures both graphs; the README's call before serving), then non-streaming
`generate_custom_voice` with bench.talker's text, its speaker (the checkpoint's first) and English, and the
official sampling parameters (temperature 0.9, top-k 50, repetition penalty 1.05; the predictor samples with
top-k 50, temperature 0.9), which both use.

What a frame is: 80 ms of audio = one decode step = the code predictor's 15 codebooks (one graph replay) + one
talker step (one graph replay) + codebook-0 sampling + the peer's `token.item()` read-back; the same unit as
bench.talker's ms per step at batch 1.

Fixed length (random weights emit EOS at random): the peer's own `min_new_tokens` is set to N together with
`max_new_tokens=N`. Its decode loop (faster_qwen3_tts/generate.py, fast_generate) passes
`suppress_tokens=[codec_eos_token_id]` to its sampler (logit set to -inf) while fewer than `min_new_tokens`
frames exist, and stops at `max_new_tokens`, so every run is exactly N frames; this script checks the count and
that no frame's codebook 0 is EOS. Nothing of the peer is patched to get there.

What is reported (per run, then the median over runs):
- ms_per_frame: the peer's own decode timer, `decode_s / steps` of fast_generate's timing dict (torch.cuda
  synchronize at both ends): the N steps after the prefill, before the codec decode. The steady state. It is
  read by wrapping `faster_qwen3_tts.generate.fast_generate`, which generate_custom_voice looks up at each call.
- prefill_ms: the peer's prefill (HF forward of the prompt, first codebook-0 sample, KV copy into the static cache).
- step_ms_p50/p90/max: host clock at each call of the predictor graph; every step ends with the peer's
  `token.item()` sync, so consecutive calls are one whole step apart (N-1 intervals per run).
- wall_ms_per_frame: the whole public call (prompt building, prefill, N steps, Code2Wav decode to 24 kHz audio) / N,
  and codec_decode_ms, the speech tokenizer's decode inside it.

Compatibility shims (recorded in the JSON as compat_shims): qwen-tts-hf 0.1.1.post1 (the peer's model code)
registers its own `ROPE_INIT_FUNCTIONS["default"]`, which reads `config.rope_theta`. transformers 5.17 (the GPU
image) prefers the registry entry when it re-initialises RoPE buffers at load time, and its MimiConfig (the
speech tokenizer's encoder) keeps rope_theta only inside `rope_parameters`, so loading fails with
"'MimiConfig' object has no attribute 'rope_theta'" (our checkpoint's speech_tokenizer/config.json is the
official one's layout). The shim wraps that entry to read `rope_parameters["rope_theta"]` when the attribute is
missing (the same inverse-frequency formula); it is applied only when the registered function is qwen_tts's.
And where torchaudio does not import, an empty stub stands in (qwen_tts imports it at load for its 25 Hz
tokenizer only). Neither touches the timed path.

The peer's torch backend is CUDA-only (from_pretrained raises "CUDA graphs require CUDA device"): without CUDA
this script stops with a message before importing it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

PEER = "faster-qwen3-tts"
EOS_NOTE = ("generate_custom_voice(min_new_tokens=N, max_new_tokens=N): the peer's fast_generate masks the codec "
            "EOS logit (-inf via sample_logits(suppress_tokens=[codec_eos_token_id])) while fewer than "
            "min_new_tokens frames exist and stops at max_new_tokens; frame count and EOS-free codebook 0 checked "
            "per run; the peer is not patched")


def text_default() -> str:
    from bench.talker import TEXT  # the same sentence as our own batch-1 timing

    return TEXT


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench.peer_faster_qwen3_tts: CUDA is not available. faster-qwen3-tts's torch backend is CUDA-only "
            "(FasterQwen3TTS.from_pretrained raises 'CUDA graphs require CUDA device'); run it on the GPU machine: "
            "bash bench/gpu_frame_speed.sh peer")


def import_peer() -> tuple[object, list[str]]:
    """Import faster_qwen3_tts and qwen_tts; apply the shims they need here. Returns (module, shims)."""
    shims = stub_torchaudio_if_broken()
    try:
        import faster_qwen3_tts
        import qwen_tts  # noqa: F401  (its import registers the RoPE initialiser patched below)
    except ImportError as e:
        raise SystemExit(
            f"bench.peer_faster_qwen3_tts: {e}. Install the peer's wheels (faster-qwen3-tts 0.5.4, qwen-tts-hf and "
            "the few packages the GPU image lacks) from .whl/peer/, as bench/gpu_frame_speed.sh peer does.") from e
    return faster_qwen3_tts, shims + patch_rope_registry()


def stub_torchaudio_if_broken() -> list[str]:
    """qwen_tts imports torchaudio.compliance.kaldi at load; only its 25 Hz tokenizer uses it (never the 12 Hz
    models). Where torchaudio is missing or does not import (a build not matching torch), an empty stub stands in,
    as tests/oracle/official_import.py does for the official package."""
    import transformers  # noqa: F401  (probes torchaudio at import: before any stub)

    try:
        import torchaudio.compliance.kaldi  # noqa: F401
        return []
    except Exception as e:  # ImportError, or OSError/RuntimeError from a mismatched build
        ta, comp, kal = (types.ModuleType(n) for n in ("torchaudio", "torchaudio.compliance",
                                                        "torchaudio.compliance.kaldi"))
        ta.compliance, comp.kaldi = comp, kal
        sys.modules.update({"torchaudio": ta, "torchaudio.compliance": comp, "torchaudio.compliance.kaldi": kal})
        return [f"torchaudio stubbed ({type(e).__name__}: {str(e)[:120]}); qwen_tts imports it at load, only its "
                "25 Hz tokenizer uses it"]


def patch_rope_registry() -> list[str]:
    """qwen_tts's "default" RoPE initialiser reads config.rope_theta; newer transformers configs (MimiConfig) keep
    it only in config.rope_parameters. Wrap the registry entry to fall back to it (same formula)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    orig = ROPE_INIT_FUNCTIONS.get("default")
    if orig is None or not getattr(orig, "__module__", "").startswith("qwen_tts"):
        return []

    def default_rope(config, device=None, seq_len=None, layer_type=None):
        if hasattr(config, "rope_theta"):
            return orig(config, device, seq_len, layer_type)
        params = getattr(config, "rope_parameters", None) or {}
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
        exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (float(params["rope_theta"]) ** exponent), 1.0

    default_rope.__module__ = __name__
    ROPE_INIT_FUNCTIONS["default"] = default_rope
    return ["transformers ROPE_INIT_FUNCTIONS['default'] (registered by qwen_tts) reads rope_parameters['rope_theta'] "
            "when a config has no rope_theta attribute (transformers 5.17's MimiConfig)"]


def first_speaker(checkpoint: str | Path) -> str:
    """bench.talker's speaker: the first of the checkpoint's spk_id."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    return next(iter(cfg["talker_config"]["spk_id"]))


def load(checkpoint: str | Path, max_seq_len: int, dtype: str, attn: str):
    from faster_qwen3_tts import FasterQwen3TTS

    return FasterQwen3TTS.from_pretrained(str(checkpoint), device="cuda", dtype=getattr(torch, dtype),
                                          attn_implementation=attn, max_seq_len=max_seq_len)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Recorder:
    """Observes one generate call: fast_generate's codes and timing dict, the host time of each predictor graph
    call (one per step) and the codec decode time. Observation only: every wrapped call is passed through."""

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[torch.Tensor | None, dict]] = []
        self.step_t: list[float] = []
        self.decode_ms: list[float] = []

    @contextlib.contextmanager
    def attached(self):
        import faster_qwen3_tts.generate as gen

        fast_generate = gen.fast_generate
        pg = self.model.predictor_graph
        st = self.model.model.model.speech_tokenizer
        pg_run, st_decode = pg.run, st.decode

        def fast_generate_rec(*a, **k):
            codes, timing = fast_generate(*a, **k)
            self.calls.append((codes, dict(timing, min_new_tokens=k.get("min_new_tokens"),
                                           max_new_tokens=k.get("max_new_tokens"))))
            return codes, timing

        def run_rec(*a, **k):
            self.step_t.append(time.perf_counter())
            return pg_run(*a, **k)

        def decode_rec(*a, **k):
            t0 = time.perf_counter()
            out = st_decode(*a, **k)
            _sync()
            self.decode_ms.append((time.perf_counter() - t0) * 1e3)
            return out

        saved = [(obj, name, vars(obj).get(name)) for obj, name in ((pg, "run"), (st, "decode"))]
        gen.fast_generate, pg.run, st.decode = fast_generate_rec, run_rec, decode_rec
        try:
            yield self
        finally:
            gen.fast_generate = fast_generate
            for obj, name, value in saved:  # back to the class's method (or the instance's own attribute)
                if value is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, value)


def run_once(model, text: str, speaker: str, language: str, frames: int, eos_id: int,
             min_new_tokens: int | None = None) -> dict:
    """One batch-1 generate_custom_voice of `frames` frames (min_new_tokens=frames unless given)."""
    rec = Recorder(model)
    with rec.attached():
        _sync()
        t0 = time.perf_counter()
        audio, sr = model.generate_custom_voice(
            text=text, speaker=speaker, language=language, max_new_tokens=frames,
            min_new_tokens=frames if min_new_tokens is None else min_new_tokens)
        _sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    (codes, timing), = rec.calls
    steps = int(timing["steps"])
    intervals = np.diff(np.asarray(rec.step_t)) * 1e3
    return {
        "frames": steps, "eos_in_codebook0": bool(codes is not None and (codes[:, 0] == eos_id).any()),
        "ms_per_frame": round(timing["decode_s"] * 1e3 / steps, 3) if steps else None,
        "prefill_ms": round(timing["prefill_ms"], 2), "decode_ms": round(timing["decode_s"] * 1e3, 2),
        "step_ms_p50": round(float(np.median(intervals)), 3) if intervals.size else None,
        "step_ms_p90": round(float(np.percentile(intervals, 90)), 3) if intervals.size else None,
        "step_ms_max": round(float(intervals.max()), 3) if intervals.size else None,
        "codec_decode_ms": round(sum(rec.decode_ms), 2),
        "wall_ms": round(wall_ms, 2), "wall_ms_per_frame": round(wall_ms / steps, 3) if steps else None,
        "audio_samples": int(sum(np.asarray(a).size for a in audio)), "sample_rate": int(sr),
    }


def check_run(row: dict, frames: int) -> None:
    if row["frames"] != frames or row["eos_in_codebook0"]:
        raise RuntimeError(
            f"the peer produced {row['frames']} frames (EOS in codebook 0: {row['eos_in_codebook0']}), expected "
            f"exactly {frames}: EOS suppression or max_seq_len (prompt + frames must stay below it) failed")


def summarize(rows: list[dict]) -> dict:
    keys = ("ms_per_frame", "prefill_ms", "step_ms_p50", "step_ms_p90", "wall_ms_per_frame", "codec_decode_ms")
    out = {f"{k}_median": round(statistics.median(r[k] for r in rows), 3) for k in keys}
    out["ms_per_frame_min"] = min(r["ms_per_frame"] for r in rows)
    out["ms_per_frame_max"] = max(r["ms_per_frame"] for r in rows)
    out["x_realtime"] = round(80.0 / out["ms_per_frame_median"], 2)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.peer_faster_qwen3_tts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="checkpoint dir (python -m stages.checkpoint random ...)")
    ap.add_argument("--frames", type=int, default=200, help="frames per run (80 ms of audio each)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs")
    ap.add_argument("--warmup-runs", type=int, default=2, help="untimed runs after the graph capture")
    ap.add_argument("--speaker", default=None, help="default: the checkpoint's first speaker (as bench.talker)")
    ap.add_argument("--language", default="English")
    ap.add_argument("--text", default=None, help="default: bench.talker's TEXT")
    ap.add_argument("--max-seq-len", type=int, default=2048, help="the peer's static cache length (its default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (the peer's default; no flash-attn here)")
    ap.add_argument("--warmup-prefill-len", type=int, default=100, help="model.warmup(prefill_len=...), README's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="results JSON path")
    args = ap.parse_args(argv)

    require_cuda()
    peer, shims = import_peer()
    import qwen_tts
    import transformers

    torch.manual_seed(args.seed)
    text = args.text or text_default()
    speaker = args.speaker or first_speaker(args.checkpoint)
    t0 = time.perf_counter()
    model = load(args.checkpoint, args.max_seq_len, args.dtype, args.attn)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.warmup(prefill_len=args.warmup_prefill_len)
    _sync()
    capture_s = time.perf_counter() - t0
    eos_id = int(model.model.model.config.talker_config.codec_eos_token_id)
    talker = model.model.model.talker
    loaded = {"talker_dtype": str(next(talker.parameters()).dtype).removeprefix("torch."),
              "attn_implementation": talker.config._attn_implementation}
    print(f"[peer] {PEER} {peer.__version__} loaded in {load_s:.1f} s, graphs captured in {capture_s:.1f} s; "
          f"{args.frames} frames x ({args.warmup_runs} warm-up + {args.runs} timed) runs, speaker {speaker}", flush=True)
    for _ in range(args.warmup_runs):
        check_run(run_once(model, text, speaker, args.language, args.frames, eos_id), args.frames)
    rows = []
    for i in range(args.runs):
        row = run_once(model, text, speaker, args.language, args.frames, eos_id)
        check_run(row, args.frames)
        rows.append(row)
        print(f"[peer] run {i}: {row['ms_per_frame']} ms/frame (steps p50 {row['step_ms_p50']}, p90 "
              f"{row['step_ms_p90']}), prefill {row['prefill_ms']} ms, whole call {row['wall_ms_per_frame']} "
              f"ms/frame incl. codec decode {row['codec_decode_ms']} ms", flush=True)
    summary = summarize(rows)
    report = {
        "peer": PEER, "peer_version": peer.__version__, "qwen_tts_version": qwen_tts.__version__,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "command": " ".join(sys.argv), "checkpoint": str(args.checkpoint), "batch": 1,
        "config": {"backend": "torch (CUDA graphs)", "dtype": args.dtype, "attn_implementation": args.attn,
                   "max_seq_len": args.max_seq_len, "warmup_prefill_len": args.warmup_prefill_len,
                   "mode": "generate_custom_voice, non_streaming_mode default (True)",
                   "sampling": "peer defaults: do_sample, temperature 0.9, top_k 50, top_p 1.0, repetition_penalty "
                               "1.05; predictor graph top_k 50, temperature 0.9"},
        "text": text, "speaker": speaker, "language": args.language, "frames": args.frames, "runs": args.runs,
        "warmup_runs": args.warmup_runs, "loaded": loaded, "load_s": round(load_s, 1),
        "graph_capture_s": round(capture_s, 1),
        "eos_suppression": EOS_NOTE, "compat_shims": shims,
        "ms_per_frame_definition": "peer's fast_generate decode_s / steps: N steps of predictor graph + talker graph "
                                   "+ sampling + token.item(), after prefill, before codec decode",
        "summary": summary, "results": rows,
    }
    print(json.dumps({"peer": PEER, "version": peer.__version__, "device": report["device"], **summary}), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
