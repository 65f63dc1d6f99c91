"""Imports the official package offline inside the oracle venv (run there, never in the main env).

`qwen_tts` imports torchaudio at module load although the 12 Hz path never uses it, and no CPU
torchaudio wheel exists: install a stub module first (transformers must be imported before it,
because transformers probes torchaudio at import).
"""

import sys
import types

import transformers  # noqa: F401  (must precede the stub)

try:
    import torchaudio  # noqa: F401
except Exception:
    ta, comp, kal = (types.ModuleType(n) for n in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"))
    ta.compliance, comp.kaldi = comp, kal
    sys.modules.update({"torchaudio": ta, "torchaudio.compliance": comp, "torchaudio.compliance.kaldi": kal})

import qwen_tts  # noqa: F401
from qwen_tts import Qwen3TTSModel, Qwen3TTSTokenizer  # noqa: F401
from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model  # noqa: F401
from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration  # noqa: F401
