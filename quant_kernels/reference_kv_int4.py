"""Pure-PyTorch reference for the int4 KV cache: the encoding, the CPU path and the oracle.

Knows: how one token's K (or V) row of one KV head is stored in an int4 cache, and the paged
cache layout of ``quant_kernels.reference`` with that row in place of ``head_dim`` elements.
Must not know: engines, requests, kernels.

Encoding (grouped asymmetric int4, one group = one token of one KV head, so the scale and zero
follow each token's own range; no calibration, nothing per layer):

- ``lo, hi = min(x), max(x)`` over the head's ``head_dim`` values (computed in float32);
- ``scale = fp16((hi - lo) / 15)``, ``zero = fp16(lo)`` (the zero is a float offset, the
  group's minimum, so 0 and 15 land on the ends of the range); both are clamped to fp16's range;
- ``code = clamp(round((x - zero) / scale), 0, 15)`` with the *stored* fp16 scale and zero
  (round half to even; a zero scale divides by 1), so reading back is consistent with what was
  written: ``x_hat = code * scale + zero`` (in float32).

Cache layout: ``torch.uint8`` ``[num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]``
(the uint8 dtype is what marks a cache as int4; fp8 caches are ``float8_e4m3fn``). One row:

- bytes ``[0, head_dim // 2)``: byte ``j`` holds element ``j`` in its low nibble and element
  ``j + head_dim // 2`` in its high nibble (the "split-half" order: a kernel reads the row once
  and gets the two halves of the head with one mask and one shift, no interleaving);
- bytes ``head_dim // 2 + (0, 1)``: the fp16 scale; ``+ (2, 3)``: the fp16 zero (little-endian).

``head_dim`` must be a multiple of 4 (the fp16 pair stays 2-byte aligned). 68 bytes per row at
head_dim 128 against 256 for fp16: 3.76x smaller.
"""

from __future__ import annotations

import torch

from quant_kernels import reference

INT4_KV_DTYPE = torch.uint8
INT4_MAX_CODE = 15
META_BYTES = 4  # fp16 scale + fp16 zero after the codes of each row
FP16_MAX = 65504.0


def is_int4(dtype: torch.dtype) -> bool:
    return dtype == INT4_KV_DTYPE


def cache_head_size(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of ``cache_dtype`` one (token, KV head) row takes: the last dim of the cache."""
    if not is_int4(cache_dtype):
        return head_dim
    if head_dim % 4:
        raise ValueError(f"an int4 KV cache needs head_dim divisible by 4, got {head_dim}")
    return head_dim // 2 + META_BYTES


def head_dim_of(cache: torch.Tensor) -> int:
    """The model's head dim behind an int4 cache ``[..., head_dim // 2 + 4]``."""
    return 2 * (cache.shape[-1] - META_BYTES)


def quantize_int4(x: torch.Tensor) -> torch.Tensor:
    """``x: [..., head_dim]`` (any float dtype) -> packed rows ``uint8 [..., head_dim // 2 + 4]``."""
    head_dim = x.shape[-1]
    cache_head_size(head_dim, INT4_KV_DTYPE)  # validates head_dim
    xf = x.float()
    lo = xf.amin(dim=-1, keepdim=True)  # [..., 1]
    hi = xf.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / INT4_MAX_CODE).clamp(-FP16_MAX, FP16_MAX).half()  # [..., 1]
    zero = lo.clamp(-FP16_MAX, FP16_MAX).half()
    s, z = scale.float(), zero.float()
    codes = torch.round((xf - z) / torch.where(s > 0, s, torch.ones_like(s))).clamp(0, INT4_MAX_CODE)
    codes = codes.to(torch.uint8)  # [..., head_dim]
    half = head_dim // 2
    packed = codes[..., :half] | (codes[..., half:] << 4)  # [..., head_dim // 2]
    meta = torch.cat([scale, zero], dim=-1).view(torch.uint8)  # [..., 4]
    return torch.cat([packed, meta], dim=-1)


def split_int4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows ``[..., head_dim // 2 + 4]`` -> (codes uint8 ``[..., head_dim]``, scale, zero
    float32 ``[..., 1]``)."""
    half = rows.shape[-1] - META_BYTES
    packed = rows[..., :half]
    codes = torch.cat([packed & 0xF, packed >> 4], dim=-1)  # [..., head_dim]
    meta = rows[..., half:].contiguous().view(torch.float16).float()  # [..., 2]
    return codes, meta[..., :1], meta[..., 1:]


def dequantize_int4(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows ``[..., head_dim // 2 + 4]`` -> values ``[..., head_dim]`` in ``dtype``."""
    codes, scale, zero = split_int4(rows)
    return (codes.float() * scale + zero).to(dtype)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache: torch.Tensor,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]; negative = skip
) -> None:
    """Quantize-on-store into an int4 cache (no scales to pass: each row carries its own)."""
    _check_cache(key_cache, key.shape[-1])
    reference.write_slots(quantize_int4(key), quantize_int4(value), key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache: torch.Tensor,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    block_tables: torch.Tensor,  # int [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [num_seqs]
    query_start_loc: torch.Tensor,  # int [num_seqs + 1]
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads], passed on to the reference
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``reference.paged_attention`` over an int4 cache: the blocks the batch reads are gathered
    and dequantized (to fp32), never the whole pool, then attended as usual."""
    _check_cache(key_cache, query.shape[-1])
    block_size = key_cache.shape[1]
    num_seqs = block_tables.shape[0]
    num_ctx_blocks = (max_seq_len + block_size - 1) // block_size
    used = block_tables[:, :num_ctx_blocks].long()  # [num_seqs, num_ctx_blocks]
    keys = dequantize_int4(key_cache[used.reshape(-1)])  # [num_seqs * num_ctx_blocks, block_size, Hkv, D]
    values = dequantize_int4(value_cache[used.reshape(-1)])
    compact = torch.arange(num_seqs * num_ctx_blocks, device=block_tables.device).view(num_seqs, num_ctx_blocks)
    return reference.paged_attention(
        query,
        keys,
        values,
        compact,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        scale,
        sliding_window,
        **({} if alibi_slopes is None else {"alibi_slopes": alibi_slopes}),
    )


def _check_cache(cache: torch.Tensor, head_dim: int) -> None:
    expected = cache_head_size(head_dim, INT4_KV_DTYPE)
    if cache.dtype != INT4_KV_DTYPE or cache.shape[-1] != expected:
        raise ValueError(
            f"an int4 KV cache for head_dim {head_dim} is uint8 [..., {expected}], got {cache.dtype} {tuple(cache.shape)}"
        )
