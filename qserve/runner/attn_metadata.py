"""``AttentionMetadata``: the only thing attention layers read about the batch.

Knows: where each token's K/V goes and which pages each sequence's context lives in. Built by
the model runner once per step and passed explicitly through the model — never a global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]: cache slot of each new token
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    seq_lens: torch.Tensor  # int64 [num_seqs]: context length after this step
    query_start_loc: torch.Tensor  # int64 [num_seqs + 1]: cumulative new-token counts
    max_query_len: int
    max_seq_len: int
    # Qwen v1 dynamic NTK: int64 [num_tokens], each token's rotary table (its sequence's alpha,
    # fixed at prefill from the prompt length); None when every token uses table 0.
    ntk_tables: torch.Tensor | None = None
