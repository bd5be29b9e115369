"""Kernel-test setup: on a machine without CUDA, run Triton kernels through the interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined, i.e. before
``quant_kernels.w4a16_triton`` is imported; pytest loads this file before the test modules.

Triton 3.6's interpreter turns a scalar into a Python int with ``int(array_of_shape_(1,))``,
which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"), so every loop with
a run-time bound fails there. ``_fix_interpreter_index`` re-registers ``__index__`` to read the
single element instead; it touches nothing outside interpreter runs.
"""

from __future__ import annotations

import os

import torch


def _fix_interpreter_index() -> None:
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_qserve_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._qserve_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _fix_interpreter_mask_dtype() -> None:
    """Triton 3.9's interpreter can hand its C loader a mask of dtype int32 (a bool ``&`` a
    scalar comparison), which it refuses ("mask has unsupported dtype"); nonzero means True."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or getattr(builder.create_masked_load, "_qserve_fixed", False):
        return
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):  # noqa: ANN001, ANN202 - interpreter TensorHandle
        if mask.data.dtype != np.bool_:
            mask = interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
        return mask

    def masked_load(self, ptrs, mask, other, *args):  # noqa: ANN001, ANN202
        return load(self, ptrs, as_bool(mask), other, *args)

    def masked_store(self, ptrs, value, mask, *args):  # noqa: ANN001, ANN202
        return store(self, ptrs, value, as_bool(mask), *args)

    masked_load._qserve_fixed = True  # type: ignore[attr-defined]
    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store


if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    _fix_interpreter_index()
    _fix_interpreter_mask_dtype()
