"""Imported first by the scripts in this folder: makes Triton 3.6's interpreter work with NumPy >= 2.4.

The interpreter turns a scalar (a loop bound loaded from memory or passed as an argument) into an int with
`int(array)` on a one-element 1-D array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to
Python scalars"); this takes the element instead. It changes nothing a kernel computes.
"""

from __future__ import annotations

import triton.runtime.interpreter as interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor_numpy2(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor_numpy2
