"""Pure-PyTorch reference for quantized KV caches (fp8 e4m3 and int8): the CPU path and the oracle.

Knows: the two quantized KV encodings and their scales, and the paged cache layout of
``quant_kernels.reference`` (``[num_blocks, block_size, num_kv_heads, head_dim]``, any strides).
Must not know: engines, requests, kernels.

Encodings (``scale``: a float32 scalar per layer, or one per KV head, ``[num_kv_heads]``):

- ``torch.float8_e4m3fn``: stored = ``clamp(x / scale, -448, 448)`` cast to e4m3 (round to
  nearest even); read = ``stored.float() * scale``. Without a scale, 1.0 (vLLM's default).
- ``torch.int8``: stored = ``clamp(round(x / scale), -127, 127)`` (round half to even);
  read = ``stored.float() * scale``. A scale is required.

Caches of the model dtype (fp16 / bf16 / fp32) pass through to ``quant_kernels.reference``;
int4 caches (``torch.uint8``, scales and zeros inside each row) to ``quant_kernels.reference_kv_int4``.
"""

from __future__ import annotations

import torch

from quant_kernels import reference, reference_kv_int4

FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.int8)
# ``CacheConfig.cache_dtype`` strings (vLLM's names) -> storage dtype; "auto": the model dtype.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
KV_CACHE_DTYPES["int4"] = reference_kv_int4.INT4_KV_DTYPE  # packed int4 rows with their own scale / zero


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_KV_DTYPES


def _qmax(cache_dtype: torch.dtype) -> float:
    if cache_dtype == torch.float8_e4m3fn:
        return FP8_E4M3_MAX
    if cache_dtype == torch.int8:
        return INT8_MAX
    raise ValueError(f"{cache_dtype} is not a quantized KV dtype; supported: {QUANTIZED_KV_DTYPES}")


def _scale_like(scale: torch.Tensor | float | None, cache_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """float32 scale broadcastable against ``[..., num_kv_heads, head_dim]``: ``[]`` or ``[Hkv, 1]``."""
    if scale is None:
        if cache_dtype == torch.int8:
            raise ValueError("an int8 KV cache needs a scale")
        scale = 1.0
    scale = torch.as_tensor(scale, dtype=torch.float32, device=device).reshape(-1)
    return scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1, 1)


def compute_kv_scale(x: torch.Tensor, cache_dtype: torch.dtype, per_head: bool = False) -> torch.Tensor:
    """Scale that maps ``max|x|`` to the code range: ``[]`` or, per head, ``[num_kv_heads]``.

    ``x: [..., num_kv_heads, head_dim]`` (e.g. calibration keys). Never zero.
    """
    xf = x.detach().float().abs()
    amax = xf.flatten(0, -3).amax(dim=(0, 2)) if per_head else xf.amax()
    return (amax / _qmax(cache_dtype)).clamp_min(1e-8)


def quantize_kv(
    x: torch.Tensor,  # [..., num_kv_heads, head_dim]
    scale: torch.Tensor | float | None,
    cache_dtype: torch.dtype,
) -> torch.Tensor:  # [..., num_kv_heads, head_dim] cache_dtype
    """Quantize-on-store."""
    qmax = _qmax(cache_dtype)
    scaled = x.float() / _scale_like(scale, cache_dtype, x.device)
    if cache_dtype == torch.int8:
        return torch.round(scaled).clamp(-qmax, qmax).to(torch.int8)
    return scaled.clamp(-qmax, qmax).to(cache_dtype)


def dequantize_kv(
    codes: torch.Tensor,  # [..., num_kv_heads, head_dim] fp8 / int8
    scale: torch.Tensor | float | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [..., num_kv_heads, head_dim] dtype
    """Dequantize-on-read."""
    return (codes.float() * _scale_like(scale, codes.dtype, codes.device)).to(dtype)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int64 [num_tokens]
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """``reference.store_kv`` with quantize-on-store for fp8 / int8 / int4 caches."""
    if reference_kv_int4.is_int4(key_cache.dtype):  # per-row scales: k_scale / v_scale unused
        reference_kv_int4.store_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    if not is_quantized(key_cache.dtype):
        reference.store_kv(key, value, key_cache, value_cache, slot_mapping)
        return
    reference.write_slots(
        quantize_kv(key, k_scale, key_cache.dtype),
        quantize_kv(value, v_scale, value_cache.dtype),
        key_cache,
        value_cache,
        slot_mapping,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # int [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [num_seqs]
    query_start_loc: torch.Tensor,  # int [num_seqs + 1]
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``reference.paged_attention`` over a quantized cache: dequantize (to fp32), then attend."""
    if reference_kv_int4.is_int4(key_cache.dtype):
        return reference_kv_int4.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len,
            scale, sliding_window, alibi_slopes=alibi_slopes,
        )  # fmt: skip
    if is_quantized(key_cache.dtype):
        key_cache = dequantize_kv(key_cache, k_scale)
        value_cache = dequantize_kv(value_cache, v_scale)
    return reference.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        scale,
        sliding_window,
        alibi_slopes=alibi_slopes,
    )
