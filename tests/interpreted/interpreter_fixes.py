"""Imported first by the scripts in this folder: makes Triton 3.6's interpreter work with NumPy >= 2.4, its tl.dot's
rows independent of their place in the block, and it skip two kinds of work whose results nobody reads (below).

The interpreter turns a scalar (a loop bound loaded from memory or passed as an argument) into an int with
`int(array)` on a one-element 1-D array, which NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to
Python scalars"); this takes the element instead. It changes nothing a kernel computes.
"""

from __future__ import annotations

import numpy as np
import triton.runtime.interpreter as interpreter
from triton.language.semantic import TritonSemantic

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


# The interpreter patches triton.language again at every call of a @triton.jit helper inside a kernel (an
# `inspect.getmembers` scan of tl, tl.core, tl.math and tl.tensor each time), although the launch in progress patched
# the same modules with the same builder already and restores them when it ends: a third of an interpreted test's
# time. A helper call whose modules the launch has patched skips it; anything else is patched as before.
_patch_lang = interpreter._patch_lang
_patched: set[int] = set()  # ids of the language modules the launch in progress patched
_langs_of: dict[int, frozenset[int]] = {}


def _patch_lang_once(fn):
    langs = _langs_of.get(id(fn))
    if langs is None:
        langs = _langs_of[id(fn)] = frozenset(
            id(v) for v in fn.__globals__.values()
            if isinstance(v, type(np)) and v in (interpreter.tl, interpreter.tl.core))
    if _patched and langs <= _patched:
        return interpreter._LangPatchScope()
    scope = _patch_lang(fn)
    if not _patched:  # a launch: its scope is restored when the launch ends
        restore = scope.restore

        def restore_and_forget() -> None:
            restore()
            _patched.clear()

        scope.restore = restore_and_forget
    _patched.update(langs)
    return scope


interpreter._patch_lang = _patch_lang_once


# An int add/sub/mul also computes, in int64, whether it overflowed, for a `device_assert` that does nothing unless the
# options' `debug` is on, and the interpreter's options never turn it on: half of the remaining time, for no check.
# Skipped when nothing would assert; the operand checks of the original are kept.
_sanitize_overflow = TritonSemantic.binary_op_sanitize_overflow_impl


def _sanitize_overflow_if_asserted(self, lhs, rhs, binary_op):
    if self.builder.options.debug:
        return _sanitize_overflow(self, lhs, rhs, binary_op)
    assert lhs.type.scalar == rhs.type.scalar and lhs.type.scalar.is_int()


TritonSemantic.binary_op_sanitize_overflow_impl = _sanitize_overflow_if_asserted
