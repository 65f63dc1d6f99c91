"""OpenAI's names on this server: its voice names -> CustomVoice speakers, its model names -> the served default.

An OpenAI client sends `voice: "alloy"` and `model: "tts-1"` unchanged. Each OpenAI voice goes to the CustomVoice
speaker closest in kind (the table in docs/serving.md, "OpenAI names"); `ingress.voice_aliases` replaces the table.
An alias is only a name: a request that names a real speaker gets it, and no uploaded voice may take an alias's
name (the upload would shadow it for nobody and confuse everyone).
"""

from __future__ import annotations

# OpenAI voice -> CustomVoice speaker of a similar kind (the speakers: stages/random_checkpoint.py SPEAKERS,
# described in docs/model.md). The English-speaking speakers first: OpenAI's clients mostly speak English.
DEFAULT_VOICE_ALIASES: dict[str, str] = {
    "alloy": "serena",  # neutral, warm
    "ash": "ryan",  # clear male
    "ballad": "aiden",  # soft, expressive male
    "cedar": "ryan",  # natural male
    "coral": "serena",  # warm female
    "echo": "aiden",  # resonant male
    "fable": "ryan",  # expressive storyteller, male
    "marin": "vivian",  # natural female
    "nova": "vivian",  # bright young female
    "onyx": "uncle_fu",  # deep, low male
    "sage": "serena",  # calm female
    "shimmer": "vivian",  # bright female
    "verse": "aiden",  # versatile male
}

# OpenAI's speech models: a request naming one goes to the served default model (the first in `models`) unless a
# model lists it among its own `aliases`
OPENAI_MODEL_NAMES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")


def alias_target(voice: str | None, aliases: dict[str, str], speakers: tuple[str, ...] | list[str]) -> str | None:
    """The speaker an OpenAI voice name stands for on a model with `speakers` (lower case), or None when `voice`
    is a speaker itself, not an alias, or an alias of a speaker the model does not have."""
    name = (voice or "").strip().lower()
    if not name or name in speakers:
        return None
    target = aliases.get(name)
    return target if target is not None and target in speakers else None


def model_names(served: dict[str, str], default_model: str | None) -> dict[str, str]:
    """`served` (lower-cased name or alias -> served name) with OpenAI's model names for the default model."""
    names = dict(served)
    for openai_name in OPENAI_MODEL_NAMES if default_model else ():
        names.setdefault(openai_name, default_model)
    return names
