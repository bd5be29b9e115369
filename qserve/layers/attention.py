"""Paged attention layer: writes the step's K/V into the cache, then attends over each
sequence's whole context.

Knows: the attention interface and its per-layer KV scales (fp8 / int8 caches). The ops come
from ``quant_kernels.attention_ops`` (Triton on CUDA, the PyTorch reference elsewhere). Must not
know: requests, scheduling or weights.
"""

from __future__ import annotations

import torch
from torch import nn

from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels import attention_ops


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        key_cache, value_cache = kv_cache
        quantized = key_cache.dtype in (torch.int8, torch.float8_e4m3fn)
        k_scale, v_scale = (self.k_scale, self.v_scale) if quantized else (None, None)
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
        )
