"""How long a prompt's layout is, computed from its ids alone (torch-free: the ingress plans with it).

`stages/talker/prefill.py` builds the layouts (§2.3 of the brief); these count their rows without the model:
the ingress sizes a request against `max_seq_len` and the engine admits it by what its KV can hold. Kept apart
from the builders so that planning a request never imports torch (a CPU ingress replica would pay seconds for
it on its first request).
"""

from __future__ import annotations

from stages.contract import TalkerPrompt


def prefill_length(prompt: TalkerPrompt) -> int:
    """Rows of the prefill `build_prefill` makes for `prompt`, computed without the model.

    The engine uses it to admit a request only when its worst-case length fits its KV slot.
    """
    n_codec = (3 if prompt.language_id is None else 4) + 2
    n_codec += 1 if (prompt.speaker_id is not None or prompt.voice is not None) else 0
    rows = len(prompt.instruct_ids or ()) + len(prompt.role_ids) + (n_codec - 1)
    t = len(prompt.text_ids)
    if prompt.voice is not None and prompt.voice.icl:
        t1 = len(prompt.voice.ref_text_ids or ()) + t + 1
        t2 = int(prompt.voice.ref_codes.shape[0]) + 1
        return rows + (t1 + t2 if prompt.non_streaming_text else t2)
    return rows + (t + 2 if prompt.non_streaming_text else 1)


def trailing_length(prompt: TalkerPrompt) -> int:
    """Rows of trailing text `build_prefill` makes for `prompt` (at least 1: tts_pad)."""
    t = len(prompt.text_ids)
    if prompt.voice is not None and prompt.voice.icl:
        if prompt.non_streaming_text:
            return 1
        t1 = len(prompt.voice.ref_text_ids or ()) + t + 1
        t2 = int(prompt.voice.ref_codes.shape[0]) + 1
        return max(t1 - t2, 1)
    return 1 if prompt.non_streaming_text else t


# The one home of the KV-fit rule: a request of `prompt_len` rows and `max_frames` frames holds its prompt, one
# position per frame and two more (the last frame's input and the step launched before a finish is seen).
EXTRA_POSITIONS = 2


def kv_positions(prompt_len: int, max_frames: int) -> int:
    """KV positions a request may occupy at its longest."""
    return prompt_len + max_frames + EXTRA_POSITIONS


def max_frames_that_fit(prompt_len: int, max_seq_len: int) -> int:
    """The most frames a request with a `prompt_len`-row prompt can generate within `max_seq_len` (0 if none)."""
    return max(max_seq_len - prompt_len - EXTRA_POSITIONS, 0)
