"""What the talker runner hands to torch.compile (CUDA), and the file that keeps the compiled work across starts.

The layers' math (stages/layers.py, through `LayerKernels.compiled`) and the decode step's glue outside the layers
(`EAGER_STEP_FUNCTIONS`, the runner's attributes of those names: eager, or each through torch.compile; `_select`
may be the sampling kernel instead) are compiled; the compile cache keys the source of every file they are in or
call into (`COMPILED_SOURCES`), so an edit there recompiles instead of loading stale work.
"""

from __future__ import annotations

from collections.abc import Callable

from stages import dynamic_compile, layers, sampling
from stages.compile_cache import CompileCache
from stages.qwen3_tts import Qwen3TTS
from stages.sampling import mask_talker_logits, select_tokens
from stages.talker import frame as frame_module
from stages.talker import model as talker_model
from stages.talker.engine_config import TalkerEngineConfig
from stages.talker.frame import advance_rows, record_step, step_talker_input

# the step's glue reads the talker's embedding tables: the model's file is traced into as well; how each function
# is handed to torch.compile (stages/dynamic_compile.py) decides what it traces
COMPILED_SOURCES = (layers.__file__, sampling.__file__, frame_module.__file__, talker_model.__file__,
                    dynamic_compile.__file__)

# the decode step's ~20 kernels of glue outside the layers (runner attributes of these names)
EAGER_STEP_FUNCTIONS: dict[str, Callable] = {
    "_select": select_tokens, "_mask": mask_talker_logits, "_step_talker_input": step_talker_input,
    "_advance_rows": advance_rows, "_record_step": record_step,
}


def talker_compile_cache(model: Qwen3TTS, config: TalkerEngineConfig) -> CompileCache | None:
    """The file keeping torch.compile's work for this talker (None: nothing compiled here, or no cache dir)."""
    if not (config.compile and model.device.type == "cuda" and config.compile_cache_dir):
        return None
    shapes = {"talker": repr(model.config.talker), "dtype": str(model.dtype)}
    return CompileCache.for_model(config.compile_cache_dir, model.device, shapes, sources=COMPILED_SOURCES,
                                  dynamo=config.kernels.compile_cache_dynamo)
