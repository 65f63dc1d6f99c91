"""The codec decoder's RVQ dequantizer and pre-transformer through torch.compile (CUDA): their elementwise work fused.

Why: a forward at serving shapes is bound by its kernel count, not by its arithmetic. The first chunk (one frame,
batch 1) launched ~580 kernels, ~390 of them the 8-layer pre-transformer's (RMSNorms in fp32, RoPE, layer scales,
SwiGLU: a dozen small kernels around each product) and ~80 the dequantizer's (two lookups, a division and an add
per codebook); compiled, ~225, and the graph replays in well under the time (the upsampler's ConvNeXt blocks
compiled too gained nothing more; docs/benchmarks.md, "A compiled first-chunk decoder").

What is compiled: `quantizer.forward` (every path: the stateful engine calls it too), `pre_transformer.forward`
(the stateless decode) and `stateful.windowed_transformer` (the stateful decode's pre-transformer over its carried
K/V windows: `stateful_transformer`). Compiled for dynamic shapes, so the engine's (batch, length) buckets share a
few variants, then captured into its CUDA graphs like the eager kernels. The result equals the eager modules' up to
rounding (fused fp32 math); the engines' GPU tests hold both to the same tolerance as the fused vocoder kernels.

Traced through `stages.dynamic_compile.compile_dynamic`: without duck shaping (the model's fixed sizes, 16
codebooks, 8 layers, 16 KV heads, head dim 64, 32 RoPE frequencies, are inputs' sizes too, so a batch of 8, 16, 32
or 64 or a chunk of 8 or 16 frames was tied to one of them and traced as a variant of its own) and with views
passed detached. Sizes of 1, which torch.compile specializes, a compiled engine pads to 2 (engine.py `min_size`),
so each function is traced once.
"""

from __future__ import annotations

from stages import dynamic_compile, layers
from stages.code2wav import quantizer, stateful, transformer
from stages.code2wav.model import Code2WavDecoder
from stages.dynamic_compile import compile_dynamic

# the files whose code is compiled, and how (the compile cache keys their source: stages/compile_cache.py)
COMPILED_SOURCES = (quantizer.__file__, transformer.__file__, stateful.__file__, layers.__file__,
                    dynamic_compile.__file__, __file__)
_MODULES = ("quantizer", "pre_transformer")


def enable(decoder: Code2WavDecoder) -> bool:
    """Compile the decoder's dequantizer and pre-transformer (on its device's first forward). Returns whether it
    did: CUDA only (on CPU the eager modules stay: the parity tests' path)."""
    if next(decoder.parameters()).device.type != "cuda":
        disable(decoder)
        return False
    for name in _MODULES:
        module = getattr(decoder, name)
        if "forward" not in vars(module):  # compile once per instance
            module.forward = compile_dynamic(type(module).forward.__get__(module))
    return True


def disable(decoder: Code2WavDecoder) -> None:
    """Back to the eager modules."""
    for name in _MODULES:
        vars(getattr(decoder, name)).pop("forward", None)


def is_enabled(decoder: Code2WavDecoder) -> bool:
    return all("forward" in vars(getattr(decoder, name)) for name in _MODULES)


def stateful_transformer():
    """`stateful.windowed_transformer` through torch.compile (for `StatefulDecoder`; call where `enable` compiled:
    CUDA). Its reads and writes of the carried windows stay outside, one gather and one scatter each."""
    return compile_dynamic(stateful.windowed_transformer)
