"""Checks of what a step wrote into the paged KV cache, shared by the graph tests.

Knows: the runner's KV layout (per layer a (key, value) pair of ``[blocks, block_size, ...]``) and
flat slot ids. Must not know: engines, models or graphs.
"""

from __future__ import annotations

import numpy as np
import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def assert_step_wrote_only(kv_caches: KVCaches, before: KVCaches, expected: KVCaches, slots: np.ndarray) -> None:
    """The caches differ from ``before`` only at ``slots`` (a pad row stores nothing), and there
    equal ``expected`` (the eager step's caches)."""
    written = torch.zeros(before[0][0].shape[:2], dtype=torch.bool)  # [blocks, block_size]
    written.view(-1)[torch.from_numpy(np.asarray(slots))] = True
    for (key, value), (k0, v0), (ke, ve) in zip(kv_caches, before, expected):
        for now, old, eager in ((key, k0, ke), (value, v0, ve)):
            assert torch.equal(now[~written], old[~written]), "a pad row stored K/V"
            torch.testing.assert_close(now[written], eager[written], atol=1e-5, rtol=1e-5)
