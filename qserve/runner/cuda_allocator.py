"""The CUDA caching allocator's setting qserve asks for, before CUDA starts in the process.

Knows: torch's caching allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` (or its newer name
``PYTORCH_ALLOC_CONF``) when CUDA initialises in a process, and a child process inherits the
environment; qserve's default is ``expandable_segments:True``. Why: with fixed-size segments the 14B
engine's allocator still held 24.69 GiB after ``empty_cache`` against the 22.49 GiB its memory plan
counts (+9.80%: fragmentation, on a 24 GiB budget), with expandable segments 23.27 GiB (+3.42%), at
the same decode speed (H100, bench/RESULTS.md, seventh session); with the weights in their own pool as
well (``qserve.model.loader``, twenty-sixth session) 22.44 GiB (-0.24%). A user's own setting, even an empty
one, is left as it is. Must not know: models, engines, the memory plan.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch

ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's two names for one setting
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``environ`` (``os.environ`` by
    default) unless either of torch's names is already set or CUDA has already started in this
    process (its allocator has then read its settings: changing the variable would only mislead the
    processes started later). Returns whether it set it."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in ALLOC_CONF_ENVS):
        return False
    if torch.cuda.is_initialized():
        return False
    environ[ALLOC_CONF_ENVS[0]] = DEFAULT_ALLOC_CONF
    return True


def allocator_setting(environ: MutableMapping[str, str] | None = None) -> str:
    """What the caching allocator of a process that starts CUDA now reads, for the logs: the first of
    torch's two names that is set (``NAME=value``), or torch's default (fixed-size segments). The
    engine logs it at start-up: the ninth session's two ``qserve serve`` layouts captured their decode
    graphs in 29.4 s and 15.6 s, and whether their allocators differed was not on record."""
    environ = os.environ if environ is None else environ
    for name in ALLOC_CONF_ENVS:
        if name in environ:
            return f"{name}={environ[name]!r}"
    return "torch's default (fixed-size segments)"
