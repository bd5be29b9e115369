"""quant_kernels: the numeric core of qserve.

Knows: the canonical packed-weight layout, pure-PyTorch reference ops (the CPU path and the
test oracle) and, lazily imported, the Triton kernels. Must not know: engines, schedulers,
checkpoint formats or anything else in this repository.
"""

import functools


@functools.lru_cache(maxsize=1)
def have_triton() -> bool:
    """Whether triton imports here (checked once; the kernels stay an optional, lazy import)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
