"""Paged attention layer: writes the step's K/V into the cache, then attends over each
sequence's whole context.

Knows: the attention math interface and which op implements it (the PyTorch reference on every
device today; Triton kernels plug in here). Must not know: requests, scheduling or weights.
"""

from __future__ import annotations

import torch
from torch import nn

from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels import reference


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        key_cache, value_cache = kv_cache
        reference.store_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return reference.paged_attention(
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
        )
