"""Rotary position embeddings (NeoX "rotate half" layout) with default, linear and llama3 scaling.

Knows: the inverse-frequency schedules and how to rotate query/key heads by position. Must not
know: attention, caches or requests. The cos/sin table is built once for every position the
model may see; the per-step work (gather and rotation of query and key) is one fused op in
``quant_kernels.elementwise_ops``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qserve.config import RopeConfig
from quant_kernels import elementwise_ops


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(rope, head_dim)  # [head_dim / 2]
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # int64 [T]
        query: torch.Tensor,  # [T, num_heads, head_dim] or [B, T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim] or [B, T, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if query.dim() == 4:  # a batch of windows sharing positions (the quantizer's calibration)
            batch = query.shape[0]
            q, k = elementwise_ops.rotary_embedding(
                positions.repeat(batch), query.flatten(0, 1), key.flatten(0, 1), self.cos, self.sin
            )
            return q.view(query.shape), k.view(key.shape)
        return elementwise_ops.rotary_embedding(positions, query, key, self.cos, self.sin)
