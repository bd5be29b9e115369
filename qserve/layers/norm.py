"""RMSNorm, computed in float32 like the reference implementations, optionally fused with the
residual add that precedes it in every decoder layer.

Knows: one normalisation and the residual stream it reads. Must not know: where it sits in a
model. The arithmetic lives in ``quant_kernels.elementwise_ops`` (one Triton kernel on CUDA,
the PyTorch reference elsewhere).
"""

from __future__ import annotations

import torch
from torch import nn

from quant_kernels import elementwise_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        return elementwise_ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self,
        x: torch.Tensor,  # [T, size]
        residual: torch.Tensor,  # [T, size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual add and the norm in one pass."""
        return elementwise_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
