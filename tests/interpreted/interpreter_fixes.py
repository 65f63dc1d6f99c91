"""Imported first by the scripts in this folder: makes Triton 3.6's interpreter work with NumPy >= 2.4, and its
tl.dot's rows independent of their place in the block.

The interpreter turns a scalar (a loop bound loaded from memory or passed as an argument) into an int with
`int(array)` on a one-element 1-D array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to
Python scalars"); this takes the element instead. It changes nothing a kernel computes.
"""

from __future__ import annotations

import numpy as np
import triton.runtime.interpreter as interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor_numpy2(tensor, scope) -> None:
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


interpreter._patch_lang_tensor = _patch_lang_tensor_numpy2


# The interpreter's tl.dot is NumPy's matmul, whose BLAS (OpenBLAS's kernels for some CPUs, e.g. AMD EPYC) can round
# a row differently by its position in the block: the row-invariance checks would then test the BLAS, not the
# kernel. Products of fp32 operands are taken in float64 (exact products; a different summation order moves the
# float64 sum by ~1e-16, which the rounding to fp32 shows only on a rounding boundary, ~1 element in 2^29); other
# dtypes as before.
_create_dot = interpreter.InterpreterBuilder.create_dot


def _create_dot_row_stable(self, a, b, d, input_precision, max_num_imprecise_acc):
    if d.data.dtype == np.float32 and a.data.dtype in (np.float32, np.float16) and b.data.dtype == a.data.dtype:
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)
    return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)


interpreter.InterpreterBuilder.create_dot = _create_dot_row_stable
