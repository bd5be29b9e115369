"""Paged attention layer: writes the step's K/V into the cache, then attends over each
sequence's whole context.

Knows: the attention interface, its per-layer KV scales (fp8 / int8 caches) and ALiBi slopes
(Baichuan2-13B) when the model declares ALiBi instead of rotary. The ops come
from ``quant_kernels.attention_ops`` (Triton on CUDA, the PyTorch reference elsewhere). Must not
know: requests, scheduling or weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels import attention_ops


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """float32 [num_heads]: 2^(-8k/n) for k = 1..n with n the largest power of two <= num_heads;
    the remaining heads take the odd k = 1, 3, 5, ... of the 2n-head sequence (Press et al.)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * k / closest) for k in range(1, closest + 1)]
    extra = [2.0 ** (-4.0 * k / closest) for k in range(1, 2 * (num_heads - closest), 2)]
    return torch.tensor(slopes + extra, dtype=torch.float32)


class PagedAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None,
        alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads] (this rank's heads)
    ) -> None:
        super().__init__()
        if alibi_slopes is not None:
            self.register_buffer("alibi_slopes", alibi_slopes.float(), persistent=False)
        else:
            self.alibi_slopes = None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window
        # Quantized (fp8 / int8) caches store x / scale. fp8 e4m3 covers +-448, so 1.0 suits
        # typical K/V ranges (vLLM's default too); int8 caches get a scale from the runner.
        self.register_buffer("k_scale", torch.tensor(1.0), persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0), persistent=False)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        *,
        kv_stored: bool = False,  # the step's keys and values are in the cache already (the rotary stored them)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        key_cache, value_cache = kv_cache
        quantized = key_cache.dtype in (torch.int8, torch.float8_e4m3fn)
        k_scale, v_scale = (self.k_scale, self.v_scale) if quantized else (None, None)
        if not kv_stored:
            attention_ops.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)
        return attention_ops.paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            metadata.max_seq_len,
            self.scale,
            self.sliding_window,
            k_scale,
            v_scale,
            alibi_slopes=self.alibi_slopes,
        )
