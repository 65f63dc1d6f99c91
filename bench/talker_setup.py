"""What a talker GPU micro-benchmark needs: the 1.7B checkpoint (a random one written in the Hugging Face layout
when none is given) loaded without its decoder, and the load generator's sentences as prompt plans with a
CustomVoice speaker (the timer: bench/kernels/gpu_timing.py)."""

from __future__ import annotations

from pathlib import Path

from bench.loadgen.sentences import load_sentences
from stages.prompts import build_prompt
from stages.qwen3_tts import Qwen3TTS
from stages.random_checkpoint import write_random_checkpoint
from stages.talker.prompt_plan import PromptPlan, plan_prompt


def talker_and_plans(checkpoint: str | None, workdir: str, count: int = 64) -> tuple[Qwen3TTS, list[PromptPlan]]:
    """The talker (bf16, CUDA) and the plans of the first `count` sentences."""
    ckpt = Path(checkpoint or Path(workdir) / "1.7b-custom_voice")
    if not (ckpt / "config.json").exists():
        write_random_checkpoint(ckpt, "1.7b", "custom_voice", dtype="bfloat16", device="cuda")
    model = Qwen3TTS.load(ckpt, device="cuda", dtype="bfloat16", decoder=False, voice=False, log=print)
    speaker = next(iter(model.config.talker.speakers))
    plans = [plan_prompt(model.config, build_prompt(model.config, model.tokenizer, s.text, speaker=speaker))
             for s in load_sentences()[:count]]
    return model, plans
