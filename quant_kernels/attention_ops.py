"""Device dispatch for paged attention: Triton kernels on CUDA, the PyTorch reference elsewhere.

Knows: which implementation serves which device and cache dtype. Must not know: models,
requests or metadata objects (the layer unpacks ``AttentionMetadata``). Triton stays an
optional, lazy import: this module imports on a machine without triton, and only the CUDA
branch touches it.

Both ops keep the reference signatures (``quant_kernels.reference``) plus optional ``k_scale``
/ ``v_scale`` (float32, a scalar per layer or ``[num_kv_heads]``) for fp8 (``float8_e4m3fn``)
and int8 caches; see ``quant_kernels.reference_kv_quant`` for the encodings. int4 caches
(``torch.uint8``, each row carrying its own scale and zero, ``quant_kernels.reference_kv_int4``)
take no scales and run ``quant_kernels.attention_int4_triton`` on CUDA.
"""

from __future__ import annotations

import torch

from quant_kernels import device as kdevice
from quant_kernels import reference_kv_int4, reference_kv_quant


def _use_triton(device: torch.device) -> bool:
    return kdevice.triton_serves(device)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write new keys and values into their cache slots (quantize-on-store for fp8 / int8)."""
    if _use_triton(key.device) and reference_kv_int4.is_int4(key_cache.dtype):
        from quant_kernels import attention_int4_triton

        attention_int4_triton.store_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    if _use_triton(key.device):
        from quant_kernels import attention_triton

        attention_triton.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        return
    reference_kv_quant.store_kv(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [num_seqs]
    query_start_loc: torch.Tensor,  # int [num_seqs + 1]
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    num_splits: int | None = None,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads]: ALiBi bias slope * (j - i)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new tokens over its paged context (see the reference).

    ``num_splits`` (Triton only): fix the split-KV count, e.g. for CUDA-graph capture, so the decode
    grid does not depend on ``max_seq_len``; by default it is chosen from the batch shape.
    """
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale)
    if _use_triton(query.device) and reference_kv_int4.is_int4(key_cache.dtype):
        from quant_kernels import attention_int4_triton

        return attention_int4_triton.paged_attention(
            *args, sliding_window, num_splits=num_splits, alibi_slopes=alibi_slopes
        )
    if _use_triton(query.device):
        from quant_kernels import attention_triton

        return attention_triton.paged_attention(
            *args, sliding_window, k_scale, v_scale, num_splits=num_splits, alibi_slopes=alibi_slopes
        )
    return reference_kv_quant.paged_attention(*args, sliding_window, k_scale, v_scale, alibi_slopes=alibi_slopes)
