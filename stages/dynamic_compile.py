"""compile_dynamic: torch.compile for the engines' functions of dynamic shapes, each traced once per shape class.

The engines compile small functions (a layer's math, the decode step's glue, the codec decoder's dequantizer and
pre-transformer) for dynamic shapes and capture them into CUDA graphs at many (batch, length) buckets. Each trace
costs a cold start one to a few seconds, and each variant is loaded again on every start from the compile cache.
Two defaults of torch.compile trace a function again for shapes a variant it has already covers:

- Duck shaping: a dynamic size equal to another input size when traced shares its symbol, and the model's fixed
  sizes are input sizes too (a weight's rows, the codec's 16 codebooks, head dims, a RoPE table's offset), so a
  bucket that happened to equal one was specialized with it and traced as a variant of its own. Off here: each size
  gets a symbol of its own. The switch is torch's private `torch.fx.experimental._config.use_duck_shape`, used here
  alone; tests/stages/test_dynamic_compile.py fails if a torch upgrade drops or ignores it.
- Views: an argument that is a view is traced with its base (Dynamo fakes the base and replays the view on it), so
  the variant's guards read the base (`x._base.size()`), and a call with a tensor that is no view (its `_base`
  None), or a view of a base of other sizes, fails them: the first layer's input is a slice of the runner's rows
  and the next layers' a fresh tensor; a step's output rows are a slice of a buffer as large as the largest bucket.
  Each view is passed detached here: the same memory (an in-place write still lands in the caller's tensor) without
  `_base`, traced by its own sizes and strides. Parameters pass as they are (Dynamo keeps their shapes static).

Sizes of 1 are still specialized (a batch or length of 1 traces its own variant): the code2wav engine pads them to
2 (stages/code2wav/engine.py `min_size`); the talker keeps batch 1 as its own variant (its one-row step is the
latency that matters most).

The function is wrapped at its first call, not before: torch.compile reads Dynamo's caching precompile switch when
it wraps, and a compile cache turns it on when its file is loaded (stages/compile_cache.py), which may come after
the engine built its functions; wrapped before, the function's Dynamo work was never recorded in the file.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config as shape_config


def _unviewed(value: Any) -> Any:
    """A view detached (no `_base`; the same memory), in a plain tuple or list too; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach() if value._base is not None and not isinstance(value, torch.nn.Parameter) else value
    if type(value) in (tuple, list):  # not a named tuple's class, which takes its fields one by one
        return type(value)(_unviewed(v) for v in value)
    return value


def compile_dynamic(fn: Callable) -> Callable:
    """`fn` through torch.compile (dynamic shapes, one graph), traced without duck shaping and with views passed
    detached (the module docstring). The setting only matters while Dynamo traces; a CUDA graph's replay runs no
    Python at all."""
    compiled_fn = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled_fn
        if compiled_fn is None:  # at the first call: the module docstring
            compiled_fn = torch.compile(fn, dynamic=True, fullgraph=True)
        args = tuple(_unviewed(a) for a in args)
        kwargs = {k: _unviewed(v) for k, v in kwargs.items()}
        with shape_config.patch(use_duck_shape=False):
            return compiled_fn(*args, **kwargs)

    return call
