"""Triton paged attention over an int4 KV cache: KV store (quantize), split-KV decode, prefill/extend.

Knows: the int4 cache encoding of ``quant_kernels.reference_kv_int4`` (uint8 rows of
``head_dim // 2`` bytes of split-half nibbles followed by an fp16 scale and an fp16 zero per
token and KV head), the paged layout (any page / token / head strides, so a layer's cache may be a
view into a shared page buffer), and the launch rules of ``quant_kernels.attention_triton``, whose
split reduce kernel, split heuristic, ``AttentionConfig``, shared kernel pieces (a decode
program's split range, a prefill program's rows and key range, the online-softmax step, the
split workspace row) and launch helpers (prefill tiles, split count, workspace, reduce) it
reuses, so the two modules differ only in how K and V are read. Must not know: models,
requests, schedulers. Imported lazily (by ``quant_kernels.attention_ops`` on CUDA only, or by tests
under ``TRITON_INTERPRET=1``).

Kernels
-------
``store_int4_kernel``: one program per new token quantizes its ``[num_kv_heads, head_dim]`` K and
  V rows: per (token, head) min / max in fp32, ``scale = fp16((max - min) / 15)``, ``zero =
  fp16(min)``, codes ``round((x - zero) / scale)`` (IEEE division, round half to even) with the
  stored fp16 values — the same arithmetic as the reference, so codes and scales are bit-equal.
``paged_attention_int4_decode_kernel``: one new token per sequence; grid ``(num_seqs,
  num_kv_heads, num_splits)``, one program per KV head and all its query heads (GQA group padded
  to ``BLOCK_G >= 16`` rows for ``tl.dot``), split-KV with an online softmax in exp2 units; with
  several splits the partials go to the fp32 workspace that ``attention_triton``'s reduce kernel
  combines.
``paged_attention_int4_prefill_kernel``: several new tokens over a paged prefix; grid
  ``(num_seqs, q_blocks, num_kv_heads)``, rows = ``BLOCK_Q`` tokens x the ``G`` query heads of a KV
  head, causal (and sliding-window) mask per row. ``store_kv`` runs first (as in the reference).

Both attention kernels take optional ALiBi slopes (``HAS_ALIBI``): ``slope_h * (key_pos -
query_pos)`` is added to the scores, so ALiBi models (Baichuan2-13B) can use an int4 cache too.

How the codes meet the math: a K tile is read once as ``[BLOCK_N, head_dim // 2]`` bytes; ``b &
15`` and ``b >> 4`` are the two halves of each key, exact small integers in fp16 / bf16, fed to
two ``tl.dot``s with the two halves of the query. The per-key scale and zero are applied to the
fp32 scores: ``q . k = scale * (q . codes) + zero * sum(q)``. For V, ``sum_n p_n (scale_n codes_n
+ zero_n) = (p * scale) @ codes + sum_n p_n zero_n``. So no tile is dequantized element by
element, no fp8 or int4 type reaches Triton, and nothing beyond sm80 is used (the same code runs
on Ampere, Ada and Hopper).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from quant_kernels import device as kdevice
from quant_kernels.attention_triton import (
    _DEFAULT_CONFIG,
    _INTERPRET,
    LOG2E,
    AttentionConfig,
    _decode_num_splits,
    _decode_split_range,
    _online_softmax_step,
    _prefill_launch,
    _prefill_rows,
    _prefill_work_item,
    _reduce_splits,
    _split_row,
    _split_workspace,
    prefill_grid_blocks,
)
from quant_kernels.reference_kv_int4 import INT4_KV_DTYPE, META_BYTES, cache_head_size

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _quantize_rows(x0, x1, mask0, mask1):
    """Two halves ``[BLOCK_H, BLOCK_DH]`` of each head's row -> (packed bytes, fp16 scale, fp16 zero)."""
    lo = tl.minimum(tl.min(tl.where(mask0, x0, float("inf")), 1), tl.min(tl.where(mask1, x1, float("inf")), 1))
    hi = tl.maximum(tl.max(tl.where(mask0, x0, float("-inf")), 1), tl.max(tl.where(mask1, x1, float("-inf")), 1))
    scale = tl.math.div_rn(hi - lo, 15.0)  # [BLOCK_H]; IEEE division as torch does it
    scale = tl.minimum(tl.maximum(scale, -65504.0), 65504.0).to(tl.float16)
    zero = tl.minimum(tl.maximum(lo, -65504.0), 65504.0).to(tl.float16)
    s = scale.to(tl.float32)
    z = zero.to(tl.float32)
    inv = tl.where(s > 0, s, 1.0)[:, None]
    # Clamp, then round to nearest even with the 1.5 * 2**23 magic number (as torch.round).
    c0 = tl.minimum(tl.maximum(tl.math.div_rn(x0 - z[:, None], inv), 0.0), 15.0)
    c1 = tl.minimum(tl.maximum(tl.math.div_rn(x1 - z[:, None], inv), 0.0), 15.0)
    c0 = ((c0 + 12582912.0) - 12582912.0).to(tl.int32)
    c1 = ((c1 + 12582912.0) - 12582912.0).to(tl.int32)
    return (c0 | (c1 << 4)).to(tl.uint8), scale, zero


@triton.jit(do_not_specialize=["num_kv_heads", "block_size"])
def store_int4_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache_ptr,  # uint8, same shape
    key_meta_ptr,  # fp16 view of key_cache: [..., head_dim // 4 + 2]; (scale, zero) at head_dim // 4
    value_meta_ptr,  # fp16 view of value_cache
    slot_mapping_ptr,  # int [num_tokens]
    num_kv_heads,
    half_dim,  # head_dim // 2
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,  # bytes
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_H: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    c = tl.arange(0, BLOCK_DH)[None, :]  # [1, BLOCK_DH] byte within the row
    # No scalar bool is broadcast against a block (Triton 3.9's interpreter mis-types that mask).
    hmask = h < tl.where(slot >= 0, num_kv_heads, 0)  # [BLOCK_H]; a negative slot stores nothing
    mask = hmask[:, None] & (c < half_dim)  # [BLOCK_H, BLOCK_DH]
    t64 = t.to(tl.int64)
    k_src = key_ptr + t64 * stride_kt + h[:, None] * stride_kh + c * stride_kd
    v_src = value_ptr + t64 * stride_vt + h[:, None] * stride_vh + c * stride_vd
    k0 = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)  # elements [0, D/2)
    k1 = tl.load(k_src + half_dim * stride_kd, mask=mask, other=0.0).to(tl.float32)  # [D/2, D)
    v0 = tl.load(v_src, mask=mask, other=0.0).to(tl.float32)
    v1 = tl.load(v_src + half_dim * stride_vd, mask=mask, other=0.0).to(tl.float32)
    kq, ks, kz = _quantize_rows(k0, k1, mask, mask)
    vq, vs, vz = _quantize_rows(v0, v1, mask, mask)
    k_row = blk * stride_kcb + off * stride_kcs + h * stride_kch  # [BLOCK_H] byte offsets
    v_row = blk * stride_vcb + off * stride_vcs + h * stride_vch
    tl.store(key_cache_ptr + k_row[:, None] + c, kq, mask=mask)
    tl.store(value_cache_ptr + v_row[:, None] + c, vq, mask=mask)
    # Row strides are even (checked by the launcher): byte offset / 2 indexes the fp16 view.
    k_meta = key_meta_ptr + (k_row + half_dim) // 2
    v_meta = value_meta_ptr + (v_row + half_dim) // 2
    tl.store(k_meta, ks, mask=hmask)
    tl.store(k_meta + 1, kz, mask=hmask)
    tl.store(v_meta, vs, mask=hmask)
    tl.store(v_meta + 1, vz, mask=hmask)


@triton.jit
def _load_codes(cache_ptr, meta_ptr, row, c, half_dim, nmask, DTYPE: tl.constexpr):
    """Rows at byte offsets ``row [BLOCK_N]`` from the cache base -> (low-half codes, high-half
    codes ``[BLOCK_N, BLOCK_DH]`` in DTYPE, fp32 scale, fp32 zero ``[BLOCK_N]``).

    The callers hint ``row`` with ``tl.multiple_of(row, ROW_ALIGN)`` in the kernel body (a hint
    made inside this helper is lost: measured in the PTX, byte loads again)."""
    b = tl.load(cache_ptr + row[:, None] + c[None, :], mask=nmask[:, None] & (c[None, :] < half_dim), other=0)
    lo = (b & 15).to(DTYPE)
    hi = (b >> 4).to(DTYPE)
    meta = meta_ptr + (row + half_dim) // 2
    scale = tl.load(meta, mask=nmask, other=0.0).to(tl.float32)
    zero = tl.load(meta + 1, mask=nmask, other=0.0).to(tl.float32)
    return lo, hi, scale, zero


@triton.jit(do_not_specialize=["num_queries_per_kv", "block_size", "sliding_window", "num_splits", "stride_bts"])
def paged_attention_int4_decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (written when not USE_SPLIT)
    part_out_ptr,  # fp32 [num_seqs, num_heads, num_splits, head_dim] (USE_SPLIT)
    part_ml_ptr,  # fp32 [num_seqs, num_heads, num_splits, 2]: running max (log2 units), sum
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache_ptr,
    key_meta_ptr,  # fp16 views of the caches (scale, zero of each row)
    value_meta_ptr,
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int [num_seqs]
    query_start_loc_ptr,  # int [num_seqs + 1]
    qk_scale,  # softmax scale * log2(e)
    alibi_ptr,  # fp32 [num_heads] ALiBi slopes (read only with HAS_ALIBI)
    num_queries_per_kv,
    half_dim,
    block_size,
    sliding_window,  # 0: none
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,  # bytes
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bts,
    USE_SPLIT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start, is_decode, seq_len, ctx_start, tile_lo, tile_hi = _decode_split_range(
        query_start_loc_ptr, seq_lens_ptr, seq, split, sliding_window, num_splits, BLOCK_N
    )

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query head within the group
    c = tl.arange(0, BLOCK_DH)  # [BLOCK_DH] column within a half of the head
    n = tl.arange(0, BLOCK_N)
    heads = kvh * num_queries_per_kv + g
    gmask = g < num_queries_per_kv
    cmask = c < half_dim
    qmask = gmask[:, None] & cmask[None, :]
    q_ptrs = query_ptr + q_start * stride_qt + heads[:, None] * stride_qh + c[None, :] * stride_qd
    q0 = tl.load(q_ptrs, mask=qmask, other=0.0)  # [BLOCK_G, BLOCK_DH] columns [0, D/2)
    q1 = tl.load(q_ptrs + half_dim * stride_qd, mask=qmask, other=0.0)  # columns [D/2, D)
    if DOT_F32:
        q0, q1 = q0.to(tl.float32), q1.to(tl.float32)
    q_sum = tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1)  # [BLOCK_G] (meets the zeros)
    if HAS_ALIBI:  # bias slope_h * (key_pos - query_pos), in log2 units like the scores
        slopes = tl.load(alibi_ptr + heads, mask=gmask, other=0.0) * 1.4426950408889634  # [BLOCK_G]

    k_head = kvh.to(tl.int64) * stride_kch  # byte offset of this KV head in a token's row
    v_head = kvh.to(tl.int64) * stride_vch
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bts

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_G, BLOCK_DH], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, BLOCK_DH], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_G], dtype=tl.float32)  # sum_n p_n * zero_n of V
    for tile in range(tile_lo, tile_hi):
        pos = ctx_start + tile * BLOCK_N + n  # [BLOCK_N] key positions
        nmask = pos < seq_len
        page = tl.load(bt_base + pos // block_size, mask=nmask, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        # [BLOCK_N] byte offsets; ROW_ALIGN (4 when the launcher checked the base and every stride)
        # lets the codes load as 32-bit words (68-byte rows at head_dim 128 are never 16-byte aligned)
        k_row = tl.multiple_of(k_head + page * stride_kcb + off * stride_kcs, ROW_ALIGN)
        k_lo, k_hi, k_s, k_z = _load_codes(key_cache_ptr, key_meta_ptr, k_row, c, half_dim, nmask, q0.dtype)
        s = tl.dot(q0, tl.trans(k_lo))
        s = tl.dot(q1, tl.trans(k_hi), s)  # [BLOCK_G, BLOCK_N] fp32 q . codes
        s = (s * k_s[None, :] + q_sum[:, None] * k_z[None, :]) * qk_scale
        if HAS_ALIBI:
            s += slopes[:, None] * (pos - (seq_len - 1)).to(tl.float32)[None, :]
        s = tl.where(nmask[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = _online_softmax_step(s, m_i, l_i)
        v_row = tl.multiple_of(v_head + page * stride_vcb + off * stride_vcs, ROW_ALIGN)
        v_lo, v_hi, v_s, v_z = _load_codes(value_cache_ptr, value_meta_ptr, v_row, c, half_dim, nmask, q0.dtype)
        ps = (p * v_s[None, :]).to(q0.dtype)
        acc0 = tl.dot(ps, v_lo, acc0 * alpha[:, None])
        acc1 = tl.dot(ps, v_hi, acc1 * alpha[:, None])
        acc_z = acc_z * alpha + tl.sum(p * v_z[None, :], 1)
        m_i = m_new

    acc0 = acc0 + acc_z[:, None]
    acc1 = acc1 + acc_z[:, None]
    smask = g < tl.where(is_decode, num_queries_per_kv, 0)  # [BLOCK_G]
    omask = smask[:, None] & cmask[None, :]
    if USE_SPLIT:
        row = _split_row(seq, heads, split, num_queries_per_kv, num_splits)  # [BLOCK_G]
        o_ptrs = part_out_ptr + row[:, None] * (2 * half_dim) + c[None, :]
        tl.store(o_ptrs, acc0, mask=omask)
        tl.store(o_ptrs + half_dim, acc1, mask=omask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=smask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=smask)
    else:
        inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        o_ptrs = out_ptr + q_start * stride_ot + heads[:, None] * stride_oh + c[None, :] * stride_od
        o_ty = out_ptr.dtype.element_ty
        tl.store(o_ptrs, (acc0 * inv_l[:, None]).to(o_ty), mask=omask)
        tl.store(o_ptrs + half_dim * stride_od, (acc1 * inv_l[:, None]).to(o_ty), mask=omask)


@triton.jit(do_not_specialize=["num_seqs", "num_queries_per_kv", "block_size", "sliding_window", "stride_bts"])
def paged_attention_int4_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache_ptr,
    key_meta_ptr,  # fp16 views of the caches
    value_meta_ptr,
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int [num_seqs]
    query_start_loc_ptr,  # int [num_seqs + 1]
    qk_scale,  # softmax scale * log2(e)
    alibi_ptr,  # fp32 [num_heads] ALiBi slopes (read only with HAS_ALIBI)
    num_seqs,
    num_queries_per_kv,
    half_dim,
    block_size,
    sliding_window,  # 0: none
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,  # bytes
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bts,
    SKIP_DECODE: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    ROW_ALIGN: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DH: tl.constexpr,
):
    seq, q_block = _prefill_work_item(query_start_loc_ptr, num_seqs, BLOCK_Q, True)
    kvh = tl.program_id(1)
    q_start, ctx_before, tok, heads, row_mask, lo, hi = _prefill_rows(
        query_start_loc_ptr, seq_lens_ptr, seq, q_block, kvh, num_queries_per_kv, sliding_window,
        SKIP_DECODE, BLOCK_M, BLOCK_Q,
    )  # fmt: skip
    c = tl.arange(0, BLOCK_DH)
    n = tl.arange(0, BLOCK_N)
    cmask = c < half_dim
    qmask = row_mask[:, None] & cmask[None, :]
    q_ptrs = query_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + c[None, :] * stride_qd
    q0 = tl.load(q_ptrs, mask=qmask, other=0.0)  # [BLOCK_M, BLOCK_DH]
    q1 = tl.load(q_ptrs + half_dim * stride_qd, mask=qmask, other=0.0)
    if DOT_F32:
        q0, q1 = q0.to(tl.float32), q1.to(tl.float32)
    q_sum = tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1)  # [BLOCK_M]
    if HAS_ALIBI:
        slopes = tl.load(alibi_ptr + heads, mask=row_mask, other=0.0) * 1.4426950408889634  # [BLOCK_M]
    q_pos = ctx_before + tok  # [BLOCK_M]

    window = tl.where(sliding_window > 0, sliding_window, 1 << 30)  # keys newer than q_pos - window
    k_head = kvh.to(tl.int64) * stride_kch
    v_head = kvh.to(tl.int64) * stride_vch
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bts

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_M, BLOCK_DH], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_DH], dtype=tl.float32)
    acc_z = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n  # [BLOCK_N]
        nmask = pos < hi
        page = tl.load(bt_base + pos // block_size, mask=nmask, other=0).to(tl.int64)
        off = (pos % block_size).to(tl.int64)
        k_row = tl.multiple_of(k_head + page * stride_kcb + off * stride_kcs, ROW_ALIGN)  # [BLOCK_N] bytes
        k_lo, k_hi, k_s, k_z = _load_codes(key_cache_ptr, key_meta_ptr, k_row, c, half_dim, nmask, q0.dtype)
        s = tl.dot(q0, tl.trans(k_lo))
        s = tl.dot(q1, tl.trans(k_hi), s)  # [BLOCK_M, BLOCK_N]
        s = (s * k_s[None, :] + q_sum[:, None] * k_z[None, :]) * qk_scale
        if HAS_ALIBI:
            s += slopes[:, None] * (pos[None, :] - q_pos[:, None]).to(tl.float32)
        visible = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        p, alpha, m_new, l_i = _online_softmax_step(s, m_i, l_i)
        v_row = tl.multiple_of(v_head + page * stride_vcb + off * stride_vcs, ROW_ALIGN)
        v_lo, v_hi, v_s, v_z = _load_codes(value_cache_ptr, value_meta_ptr, v_row, c, half_dim, nmask, q0.dtype)
        ps = (p * v_s[None, :]).to(q0.dtype)
        acc0 = tl.dot(ps, v_lo, acc0 * alpha[:, None])
        acc1 = tl.dot(ps, v_hi, acc1 * alpha[:, None])
        acc_z = acc_z * alpha + tl.sum(p * v_z[None, :], 1)
        m_i = m_new

    inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)  # rows outside the block: l = 0, not stored
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + c[None, :] * stride_od
    o_ty = out_ptr.dtype.element_ty
    tl.store(o_ptrs, ((acc0 + acc_z[:, None]) * inv_l[:, None]).to(o_ty), mask=qmask)
    tl.store(o_ptrs + half_dim * stride_od, ((acc1 + acc_z[:, None]) * inv_l[:, None]).to(o_ty), mask=qmask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check_cache(cache: torch.Tensor, head_dim: int) -> None:
    """uint8 ``[..., head_dim // 2 + 4]`` with the codes contiguous and even byte strides (so the
    fp16 (scale, zero) pair of each row is 2-byte aligned)."""
    expected = cache_head_size(head_dim, INT4_KV_DTYPE)
    if cache.dtype != INT4_KV_DTYPE or cache.dim() != 4 or cache.shape[-1] != expected:
        raise ValueError(
            f"an int4 KV cache for head_dim {head_dim} is uint8 [num_blocks, block_size, num_kv_heads, {expected}], "
            f"got {cache.dtype} {tuple(cache.shape)}"
        )
    if cache.stride(-1) != 1 or any(st % 2 for st in cache.stride()[:-1]) or cache.storage_offset() % 2:
        raise ValueError(f"an int4 KV cache needs contiguous rows and even strides, got strides {cache.stride()}")


def _aligned4(cache: torch.Tensor) -> bool:
    """Every (token, head) row starts on a 4-byte boundary (base and all strides)."""
    return cache.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in cache.stride()[:3])


def _meta_view(cache: torch.Tensor) -> torch.Tensor:
    """The same bytes as fp16 (only the base pointer is used; the kernels index it as byte offset // 2)."""
    return cache.view(torch.float16)  # [..., head_dim // 4 + 2]


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache: torch.Tensor,  # uint8, same shape
    slot_mapping: torch.Tensor,  # int [num_tokens]; negative: skip
) -> None:
    """Quantize new keys and values into their int4 cache slots (``reference_kv_int4.store_kv``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(key_cache, head_dim)
    _check_cache(value_cache, head_dim)
    if num_tokens == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_dh = triton.next_power_of_2(head_dim // 2)
    store_int4_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        _meta_view(key_cache),
        _meta_view(value_cache),
        slot_mapping,
        num_kv_heads,
        head_dim // 2,
        key_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *key_cache.stride()[:3],
        *value_cache.stride()[:3],
        BLOCK_H=block_h,
        BLOCK_DH=block_dh,
        num_warps=4 if block_h * block_dh >= 512 else 1,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # uint8 [num_blocks, block_size, num_kv_heads, head_dim // 2 + 4]
    value_cache: torch.Tensor,  # uint8, same shape
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # int [num_seqs]
    query_start_loc: torch.Tensor,  # int [num_seqs + 1]
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,  # fp32 [num_heads]
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
) -> torch.Tensor:
    """Same contract as ``reference_kv_int4.paged_attention``; returns ``out``.

    ``alibi_slopes``: add ``slope_h * (key_pos - query_pos)`` to head ``h``'s scores (ALiBi,
    Baichuan2-13B); None: no bias.

    ``max_query_len == 1``: split-KV decode only. Otherwise the prefill kernel, plus (with several
    sequences) the decode kernel for the sequences that have one new token.
    """
    cfg = config or _DEFAULT_CONFIG
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    _check_cache(key_cache, head_dim)
    _check_cache(value_cache, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0 or num_seqs == 0:
        return out
    window = int(sliding_window) if sliding_window else 0
    qk_scale = float(scale) * LOG2E
    half = head_dim // 2
    block_dh = max(16, triton.next_power_of_2(half))  # tl.dot needs K >= 16
    km, vm = _meta_view(key_cache), _meta_view(value_cache)
    has_alibi = alibi_slopes is not None
    if has_alibi:
        if alibi_slopes.numel() != num_heads:
            raise ValueError(f"alibi_slopes must have num_heads={num_heads} elements, got {alibi_slopes.numel()}")
        alibi_slopes = alibi_slopes.to(device=query.device, dtype=torch.float32).contiguous()
    alibi = alibi_slopes if has_alibi else kdevice.placeholder(query.device, torch.float32)  # never read then
    cache_args = (*key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0))
    row_align = 4 if all(_aligned4(cache) for cache in (key_cache, value_cache)) else 1

    run_decode = max_query_len == 1 or num_seqs > 1
    run_prefill = max_query_len > 1
    if run_prefill:
        block_m, block_q, block_n, prefill_warps, prefill_stages = _prefill_launch(cfg, group, head_dim)
        grid = (prefill_grid_blocks(num_tokens, num_seqs, block_q), num_kv_heads)
        paged_attention_int4_prefill_kernel[grid](
            out,
            query,
            key_cache,
            value_cache,
            km,
            vm,
            block_tables,
            seq_lens,
            query_start_loc,
            qk_scale,
            alibi,
            num_seqs,
            group,
            half,
            block_size,
            window,
            *query.stride(),
            *out.stride(),
            *cache_args,
            SKIP_DECODE=run_decode,
            HAS_ALIBI=has_alibi,
            ROW_ALIGN=row_align,
            DOT_F32=_INTERPRET,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            BLOCK_DH=block_dh,
            num_warps=prefill_warps,
            num_stages=prefill_stages,
        )
    if run_decode:
        num_splits = _decode_num_splits(cfg, num_splits, num_seqs, num_kv_heads, max_seq_len, window, query.device)
        block_n = cfg.decode_block_n or (32 if head_dim > 128 else 64)
        use_split = num_splits > 1
        part_out, part_ml = _split_workspace(out, num_seqs, num_heads, num_splits, head_dim)
        paged_attention_int4_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
            out,
            part_out,
            part_ml,
            query,
            key_cache,
            value_cache,
            km,
            vm,
            block_tables,
            seq_lens,
            query_start_loc,
            qk_scale,
            alibi,
            group,
            half,
            block_size,
            window,
            num_splits,
            *query.stride(),
            *out.stride(),
            *cache_args,
            USE_SPLIT=use_split,
            HAS_ALIBI=has_alibi,
            ROW_ALIGN=row_align,
            DOT_F32=_INTERPRET,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_N=block_n,
            BLOCK_DH=block_dh,
            num_warps=cfg.decode_num_warps,
            num_stages=cfg.decode_num_stages,
        )
        if use_split:
            _reduce_splits(out, part_out, part_ml, query_start_loc, num_seqs, num_heads, head_dim, num_splits)
    return out


def decode_kv_bytes(num_seqs: int, ctx_len: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of K and V one decode step must read from an int4 cache (codes, scales and zeros)."""
    return 2 * num_seqs * ctx_len * num_kv_heads * (head_dim // 2 + META_BYTES)


__all__ = ["decode_kv_bytes", "paged_attention", "store_kv"]
