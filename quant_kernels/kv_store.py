"""Where a step's new keys and values go in the paged cache, for an op that writes them on its way
(the rotary launch unless ``QSERVE_FUSED_ROPE_KV_STORE=0``; ``qserve.model.llama``).

Knows: the model-dtype paged cache layout (``[num_blocks, block_size, num_kv_heads, head_dim]``, as
``quant_kernels.reference.store_kv`` writes it) and what an op needs to store into it. Must not know:
models, layers, kernels. fp8 / int8 / int4 caches keep their own store (scales, packing): an op that
takes a ``KVStore`` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVStore:
    """The values and cache slots that go with an op's keys: the op writes its output keys and these
    values to ``key_cache`` / ``value_cache`` at ``slot_mapping`` (a negative slot: a pad row, skipped)."""

    value: torch.Tensor  # [T, num_kv_heads, head_dim], any token / head strides
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], the keys' dtype
    value_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # int [T]


def check_kv_store(store: KVStore, key_shape: torch.Size | tuple[int, ...], key_dtype: torch.dtype) -> None:
    """Refuse a store the fused op cannot do as ``reference.store_kv`` does: another cache dtype than
    the keys' (a quantized cache needs its scales), caches whose heads and dims are not contiguous,
    values or slots that do not match the keys."""
    num_tokens, num_kv_heads, head_dim = key_shape
    for name, cache in (("key_cache", store.key_cache), ("value_cache", store.value_cache)):
        if cache.dtype != key_dtype:
            raise ValueError(f"kv_store: {name} is {cache.dtype}, the keys {key_dtype}: only a model-dtype cache")
        if cache.dim() != 4 or tuple(cache.shape[2:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"kv_store: {name} {tuple(cache.shape)} is not [blocks, block_size, {num_kv_heads}, {head_dim}]"
            )
        if cache.stride(3) != 1 or cache.stride(2) != head_dim:
            raise ValueError(f"kv_store: {name}'s heads and dims must be contiguous, strides {cache.stride()}")
    if tuple(store.value.shape) != (num_tokens, num_kv_heads, head_dim):
        raise ValueError(f"kv_store: value {tuple(store.value.shape)} does not match the keys {tuple(key_shape)}")
    if store.slot_mapping.shape != (num_tokens,):
        raise ValueError(f"kv_store: slot_mapping {tuple(store.slot_mapping.shape)} is not [{num_tokens}]")
