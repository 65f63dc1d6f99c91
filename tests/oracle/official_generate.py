"""Runs the official qwen-tts 0.1.1 end to end on a checkpoint directory (inside the oracle venv).

    python official_generate.py JOBS.json OUT_DIR

JOBS.json: {"checkpoint": DIR, "jobs": [{"name", "api": custom_voice|voice_design|voice_clone, "text",
"speaker", "language", "instruct", "non_streaming_mode", "ref_audio", "ref_text", "x_vector_only",
"frames"}]}. Greedy decoding (do_sample=False, subtalker_dosample=False), EOS suppressed by a hook on
`codec_head` so that every job yields exactly `frames` frames. For each job OUT_DIR/<name>.pt holds
the codes (T, 16), the official waveform, the talker logits of every step and the code-predictor
logits of every frame (captured by hooks, before EOS suppression), and for voice clones the
reference codes and x-vector.
"""

import json
import sys
from pathlib import Path

import official_import  # noqa: F401  (torchaudio stub + official package)
import torch
from qwen_tts import Qwen3TTSModel

EOS = 2150


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity on a GPU: no TF32 anywhere
    torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, spec.get("dtype", "float32"))
    tts = Qwen3TTSModel.from_pretrained(spec["checkpoint"], device_map=spec.get("device", "cpu"), dtype=dtype,
                                        attn_implementation="sdpa")
    model = tts.model
    talker_logits, cp_logits = [], []

    def on_codec_head(_m, _inp, output):
        talker_logits.append(output[:, -1].detach().clone())
        output = output.clone()
        output[..., EOS] = float("-inf")
        return output

    model.talker.codec_head.register_forward_hook(on_codec_head)
    for head in model.talker.code_predictor.lm_head:
        head.register_forward_hook(lambda _m, _i, o: cp_logits.append(o[:, -1].detach().clone()))

    captured = {}
    original_generate = model.generate

    def recording_generate(*args, **kwargs):
        codes, hiddens = original_generate(*args, **kwargs)
        captured["codes"] = [c.clone() for c in codes]
        return codes, hiddens

    model.generate = recording_generate

    for job in spec["jobs"]:
        talker_logits.clear()
        cp_logits.clear()
        gen = dict(do_sample=False, subtalker_dosample=False, max_new_tokens=job["frames"] + 1)
        extra = {}
        if job["api"] == "custom_voice":
            wavs, sr = tts.generate_custom_voice(
                job["text"], speaker=job["speaker"], language=job.get("language"), instruct=job.get("instruct"),
                non_streaming_mode=job.get("non_streaming_mode", True), **gen)
        elif job["api"] == "voice_design":
            wavs, sr = tts.generate_voice_design(
                job["text"], instruct=job.get("instruct", ""), language=job.get("language"),
                non_streaming_mode=job.get("non_streaming_mode", True), **gen)
        else:
            items = tts.create_voice_clone_prompt(job["ref_audio"], ref_text=job.get("ref_text"),
                                                  x_vector_only_mode=job.get("x_vector_only", False))
            wavs, sr = tts.generate_voice_clone(
                job["text"], language=job.get("language"), voice_clone_prompt=items,
                non_streaming_mode=job.get("non_streaming_mode", False), **gen)
            extra["x_vector"] = items[0].ref_spk_embedding.float()
            if items[0].ref_code is not None:
                extra["ref_codes"] = items[0].ref_code.long()
        result = {
            "codes": captured["codes"][0].long(),
            "wav": torch.from_numpy(wavs[0]).float(),
            "sample_rate": sr,
            "talker_logits": torch.cat(talker_logits).float(),  # [steps, 3072]
            "cp_logits": torch.cat(cp_logits).float().view(-1, 15, cp_logits[0].shape[-1]),  # [frames, 15, 2048]
            **extra,
        }
        torch.save({k: v.cpu() if torch.is_tensor(v) else v for k, v in result.items()}, out / f"{job['name']}.pt")
        print(f"{job['name']}: {tuple(captured['codes'][0].shape)}", flush=True)


if __name__ == "__main__":
    main()
