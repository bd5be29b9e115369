"""Pure-PyTorch reference for the per-token elementwise ops of a decoder layer: the CPU path and
the oracle of ``quant_kernels.elementwise_triton``.

Knows: the exact numerics of RMSNorm (Hugging Face Llama's: normalise in float32, round to the
activation dtype, then multiply by the weight), the residual add fused in front of it, NeoX
"rotate half" rotary embedding from a float32 cos/sin table (alone, or after a per-head RMSNorm
of query and key: Qwen3's q/k norms, which the Triton path fuses into the rotary's launch), and
SiLU-gated MLP activation.
Must not know: models, layers, kernels or devices (every op runs on whatever device its
inputs are on).

Every op returns new tensors and never writes its inputs: callers may hold views of them (a
residual stream, q/k views into one fused qkv tensor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,  # [..., H], any strides
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [..., H], contiguous; dtype of ``weight * x`` (x's dtype when they match)
    """``weight * (x * rsqrt(mean(x**2) + eps))``, the normalisation in float32."""
    x_float = x.float()
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed.to(x.dtype)).contiguous()


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new_residual [T, H])
    """``(rms_norm(x + residual), x + residual)``; the sum is rounded to x's dtype before the norm."""
    new_residual = (x + residual).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(
    positions: torch.Tensor,  # int64 [T]
    query: torch.Tensor,  # [T, Hq, D], any strides
    key: torch.Tensor,  # [T, Hk, D], any strides
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,  # float32 [max_positions, D / 2]
) -> tuple[torch.Tensor, torch.Tensor]:  # (query [T, Hq, D], key [T, Hk, D]), contiguous
    """NeoX rotary embedding: each head's halves ``(x1, x2)`` become ``(x1 c - x2 s, x2 c + x1 s)``."""
    cos_t = cos[positions].unsqueeze(1)  # [T, 1, D / 2]
    sin_t = sin[positions].unsqueeze(1)
    return _rotate(query, cos_t, sin_t), _rotate(key, cos_t, sin_t)


def qk_norm_rotary_embedding(
    positions: torch.Tensor,  # int64 [T]
    query: torch.Tensor,  # [T, Hq, D], any strides
    key: torch.Tensor,  # [T, Hk, D], any strides
    q_weight: torch.Tensor,  # [D]
    k_weight: torch.Tensor,  # [D]
    eps: float,
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,  # float32 [max_positions, D / 2]
) -> tuple[torch.Tensor, torch.Tensor]:  # (query [T, Hq, D], key [T, Hk, D]), contiguous
    """``rms_norm`` of each head of query and key (over its D dims), then ``rotary_embedding``:
    exactly those three ops, so a caller that moves to this one gets the same results here."""
    return rotary_embedding(positions, rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps), cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)`` (the fused gate/up projection)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
