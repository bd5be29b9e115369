"""Bytes of weight a loaded module holds on its device, quantized weights included.

Why not ``parameters()``: a W4A16 linear layer keeps its packed weights (the kernels' layout) as
plain attributes, and a mixture-of-experts block its prepared experts, so a parameter count of a
4-bit model sees only its embedding, lm_head and norms (for a 14B model about 3.1 of 9.8 GB). A
ratio of two models' bytes (speculation's draft cost) built on that count is off by the missing
weights.

Knows: which layers hold weights outside their parameters (``Linear`` through its method's
``weight_nbytes``, ``SparseMoeBlock`` through ``expert_nbytes``). Must not know: checkpoints, the
memory plan, the engine.
"""

from __future__ import annotations

from torch import nn

from qserve.layers.linear import DenseLinearMethod, Linear
from qserve.layers.moe import SparseMoeBlock


def held_weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer under ``module``, plus the quantized weights its linear
    layers and expert blocks hold outside them."""
    total = 0
    for sub in module.modules():
        total += sum(t.numel() * t.element_size() for t in (*sub.parameters(False), *sub.buffers(False)))
        if isinstance(sub, Linear) and not isinstance(sub.method, DenseLinearMethod):
            total += sub.method.weight_nbytes(sub)  # (the packed weights: not parameters)
        elif isinstance(sub, SparseMoeBlock):
            total += sub.expert_nbytes()
    return total
