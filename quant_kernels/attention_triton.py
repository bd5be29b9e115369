"""Triton paged-attention kernels: KV store, split-KV decode, prefill/extend, split reduce.

Knows: the paged KV cache layout of ``quant_kernels.reference`` (``[num_blocks, block_size,
num_kv_heads, head_dim]`` per layer, any strides: a layer's cache may be a view with a page
stride into a shared page buffer), the fp8 (e4m3fn) and int8 KV encodings of
``quant_kernels.reference_kv_quant``, and which launch configuration serves which batch. Must
not know: models, requests, schedulers. Imported lazily (by ``quant_kernels.attention_ops`` on
CUDA only, or by tests under ``TRITON_INTERPRET=1``).

Kernels
-------
``store_kv_kernel``: one program per new token writes its ``[num_kv_heads, head_dim]`` K and V
  rows to slot ``slot_mapping[t]`` (negative slots are skipped: padding tokens), quantizing on
  the way for fp8 / int8 caches (``x / scale``, clamped, round-to-nearest-even, bit-exact with
  the torch casts in the reference up to the rounding of the fp32 division).
``paged_attention_decode_kernel``: sequences with exactly one new token. Grid ``(num_seqs,
  num_kv_heads, num_splits)``: one program owns one KV head and ALL its query heads (the GQA
  group, padded to ``BLOCK_G >= 16`` rows for ``tl.dot``), so each K/V tile is read once per KV
  head. The visible context (``[max(0, L - window), L)``) is cut into ``num_splits`` runs of
  ``BLOCK_N``-token tiles (split-KV / flash-decoding); each program runs an online softmax
  (exp2, fp32 max / sum / accumulator) over its run. With one split it writes the output;
  otherwise it writes its partial (unnormalized accumulator, max, sum) to an fp32 workspace and
  ``paged_attention_reduce_kernel`` combines the partials of each ``(seq, head)`` in a second
  launch.
``paged_attention_decode_packed_kernel``: the decode kernel for fp8 / int8 caches (the default
  when the head dim is a power of two >= 64 and the cache rows are contiguous): K/V are read as
  int32 words of 4 codes, two codes become two fp16 lanes of one 32-bit word in ~2.5 integer ops
  per code, and the head dim is processed as 4 interleaved slices (4 partial ``tl.dot``s), so
  codes are never re-interleaved. 2x faster than byte-wise reads on an H200 (bench/RESULTS_attention.md).
``paged_attention_prefill_kernel``: sequences with several new tokens over a paged prefix
  (chunked prefill, prefix-cache hits, plain prefill). Flat grid ``(num_tokens // BLOCK_Q +
  num_seqs, num_kv_heads)`` over the query blocks that exist (``_prefill_work_item``: a program
  finds its sequence by binary search over ``query_start_loc``; decode sequences of a mixed batch
  cost one empty program each, not a row of them): a program's ``BLOCK_M`` rows are ``BLOCK_Q =
  BLOCK_M // G`` consecutive new tokens times the ``G`` query heads of one KV head (GQA packing:
  K/V read once per KV head), iterating key tiles from the window start to its last query
  position; tiles wholly before the block's first query position skip the mask, the rest apply
  the causal (and sliding-window) mask per row. Tiles by device and chunk length: ``_prefill_launch``. The new tokens' K/V are read from the cache, so
  ``store_kv`` runs first (as in the reference).

The kernels of this module and of ``attention_int4_triton`` share their index, mask and softmax
pieces (``_decode_split_range``, ``_prefill_rows``, ``_online_softmax_step``, ``_split_row``;
Triton inlines them: on sm90 the decode kernels' PTX instructions are unchanged from when the
pieces were written out in each kernel, the prefill kernels' are the same instructions in
another order) and their host-side launch helpers (the int4 decode's partials go through this
module's workspace and reduce kernel).

Mixed batches (``max_query_len > 1`` with several sequences) launch both: the prefill kernel
skips sequences with one new token and the decode kernel skips the others. The decision is made
on the device from ``query_start_loc``, so there is no host sync.

Quantized caches: codes are loaded as bytes and turned into the activation dtype exactly
(an e4m3 code is an fp16 number with its exponent re-biased: ``(code & 0x7f) << 7`` plus the
sign, reinterpreted as fp16, times 256; int8 codes are exact integers in fp16/bf16), fed to
``tl.dot`` as is, and the per-layer or per-head scales are applied to the fp32 scores
(``k_scale``) and the fp32 output (``v_scale``). No fp8 arithmetic or fp8 type conversion is
used, so the same code runs on sm80/sm86 (Ampere has no fp8 conversion instructions, and
Triton refuses ``fp8e4nv`` below sm89) and on Hopper; no Hopper-only instruction appears.

Splits: ``num_splits`` is a launch argument (default: ``choose_num_splits`` from the batch
shape and the device's SM count). Under CUDA graphs pass a fixed ``num_splits`` so the grid does
not depend on ``max_seq_len``; the partition of each sequence is computed in the kernel from its
own length, so any fixed value is correct.

A fused reduce (the last split program of each ``(seq, kv head)`` combining the splits in the decode
launch, opt-in ``QSERVE_ATTN_FUSED_REDUCE=1``) measured slower than the reduce launch twice on an H100
(Qwen3-30B-A3B's decode, bench/RESULTS.md) and was deleted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quant_kernels import device as kdevice
from quant_kernels.pdl import launch_options

# Under TRITON_INTERPRET=1 (CPU tests) bf16 tl.dot gives garbage in Triton 3.6's interpreter:
# dots run in fp32 there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

KV_NONE, KV_FP8, KV_INT8 = 0, 1, 2
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------------------------
# Element helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fp8e4m3_to_f16(code):
    """uint8 e4m3fn codes -> the exact fp16 values (codes 0x7f / 0xff, NaN, never stored)."""
    bits = ((code & 0x7F).to(tl.uint16) << 7) | ((code & 0x80).to(tl.uint16) << 8)
    # e4m3 bias 7 vs fp16 bias 15: the reinterpreted value is 2**-8 times the e4m3 value
    # (subnormals included); the product is exact.
    return bits.to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _f32_to_fp8e4m3(x):
    """fp32 in [-448, 448] -> uint8 e4m3fn codes, round to nearest even (as torch's cast)."""
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # Normal e4m3 (a >= 2**-6): round the fp32 mantissa to 3 bits, re-bias the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal e4m3: multiples of 2**-9; the 2**23 magic number rounds to nearest even.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def _load_kv_tile(ptrs, mask, KV_QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """Load a K or V tile and return it in ``DTYPE`` (codes of quantized caches, unscaled)."""
    if KV_QUANT == 1:
        raw = tl.load(ptrs, mask=mask, other=0)  # uint8 e4m3 codes
        return _fp8e4m3_to_f16(raw).to(DTYPE)
    elif KV_QUANT == 2:
        raw = tl.load(ptrs, mask=mask, other=0)  # int8 codes
        return raw.to(DTYPE)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)


# ----------------------------------------------------------------------------------------------
# Pieces every paged-attention kernel shares (this module's and ``attention_int4_triton``'s)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_range(
    query_start_loc_ptr, seq_lens_ptr, seq, split, sliding_window, num_splits, BLOCK_N: tl.constexpr
):
    """A decode program's share of its sequence: the visible context ``[max(0, L - window), L)``
    cut into ``num_splits`` runs of ``BLOCK_N``-key tiles. Returns ``(q_start, is_decode,
    seq_len, ctx_start, tile_lo, tile_hi)``; sequences with other than one new token belong to
    the prefill kernel and get no tiles."""
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    is_decode = q_len == 1
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_start = tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)
    num_tiles = tl.where(is_decode, tl.cdiv(seq_len - ctx_start, BLOCK_N), 0)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    return q_start, is_decode, seq_len, ctx_start, tile_lo, tile_hi


@triton.jit
def _split_row(seq, heads, split, num_queries_per_kv, num_splits):
    """Row of ``(seq, head, split)`` in the split-KV workspace ``[num_seqs, num_heads, num_splits, ...]``
    (grid axis 1 runs over KV heads, each owning ``num_queries_per_kv`` query heads)."""
    return (seq.to(tl.int64) * tl.num_programs(1) * num_queries_per_kv + heads) * num_splits + split


@triton.jit
def _prefill_work_item(query_start_loc_ptr, num_seqs, BLOCK_Q: tl.constexpr, REVERSE: tl.constexpr):
    """``(seq, q_block)`` of this program on the flat prefill grid axis 0. Sequence ``s`` owns the
    programs ``[first(s), first(s + 1))`` with ``first(s) = query_start_loc[s] // BLOCK_Q + s``:
    at least ``cdiv(q_len, BLOCK_Q)`` of them whatever the alignment of its first token, so a grid
    of ``num_tokens // BLOCK_Q + num_seqs`` programs covers every query block of every sequence
    without the host knowing the lengths (surplus programs, and one per decode sequence of a mixed
    batch, get an empty block). The owner is found by binary search over ``first``. ``REVERSE``
    hands out the last (longest causal) blocks first: the order ``pytest -m gpu`` passed with; grid
    order measured as fast (bench/RESULTS.md, issue 25) and becomes the default once it has passed too."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    lo = pid * 0  # int32 scalars carried by the loop: the owner is in [lo, hi)
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        right = first <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    q_block = pid - (tl.load(query_start_loc_ptr + lo).to(tl.int32) // BLOCK_Q + lo)
    return lo, q_block


@triton.jit
def _prefill_rows(
    query_start_loc_ptr,
    seq_lens_ptr,
    seq,
    q_block,
    kvh,
    num_queries_per_kv,
    sliding_window,
    SKIP_DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """A prefill program's rows (``BLOCK_Q`` new tokens x the query heads of KV head ``kvh``) and
    its key range. Returns ``(q_start, ctx_before, tok, heads, row_mask, lo, hi)``: ``tok`` /
    ``heads`` / ``row_mask`` are ``[BLOCK_M]``; keys run over ``[lo, hi)``, from the window start to
    one past the block's last query position (empty for an empty block)."""
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start).to(tl.int32)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_before = seq_len - q_len  # cached tokens before this step's new ones
    if SKIP_DECODE:
        q_len = tl.where(q_len == 1, 0, q_len)  # single-token sequences go to the decode kernel
    r = tl.arange(0, BLOCK_M)  # [BLOCK_M] row = (token in block, head in group)
    tok = q_block * BLOCK_Q + r // num_queries_per_kv  # [BLOCK_M] token index within the sequence
    heads = kvh * num_queries_per_kv + r % num_queries_per_kv  # [BLOCK_M]
    row_mask = (r < BLOCK_Q * num_queries_per_kv) & (tok < q_len)
    first_q = ctx_before + q_block * BLOCK_Q
    hi = ctx_before + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # one past the last query position
    lo = tl.where(sliding_window > 0, tl.maximum(first_q - sliding_window + 1, 0), 0)
    hi = tl.where(first_q < hi, hi, lo)  # an empty query block iterates nothing
    return q_start, ctx_before, tok, heads, row_mask, lo, hi


@triton.jit
def _online_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax over scores ``s [rows, BLOCK_N]`` in log2 units (masked
    keys -inf). Returns ``(p, alpha, m_new, l_new)``: the tile's weights, the factor that rescales
    what was accumulated so far, the new running max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_kv_heads", "block_size"])
def store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] (uint8 view for fp8)
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # int [num_tokens]
    k_scale_ptr,  # fp32 [1] or [num_kv_heads] (unused unless KV_QUANT)
    v_scale_ptr,  # fp32 [1] or [num_kv_heads]
    num_kv_heads,
    head_dim,
    block_size,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_scale_h,  # 0 for a per-layer scale, 1 for per-head
    KV_QUANT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL: wait for the kernel before first
):
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    # Masks are built from block comparisons only: a scalar condition is folded into a bound
    # (a negative slot writes nothing), never broadcast as a scalar bool, whose splat some Triton
    # interpreters turn into int32.
    h_lim = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (h < h_lim) & (d < head_dim)  # [BLOCK_H, BLOCK_D]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d * stride_kd, mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d * stride_vd, mask=mask, other=0.0)
    if KV_QUANT != 0:
        hmask = h < num_kv_heads
        k_scale = tl.load(k_scale_ptr + h * stride_scale_h, mask=hmask, other=1.0)  # [BLOCK_H, 1]
        v_scale = tl.load(v_scale_ptr + h * stride_scale_h, mask=hmask, other=1.0)
        # div_rn: IEEE division as torch does it (Triton's plain '/' is approximate on CUDA).
        kf = tl.math.div_rn(k.to(tl.float32), k_scale)
        vf = tl.math.div_rn(v.to(tl.float32), v_scale)
        if KV_QUANT == 1:
            kq = _f32_to_fp8e4m3(tl.minimum(tl.maximum(kf, -448.0), 448.0))
            vq = _f32_to_fp8e4m3(tl.minimum(tl.maximum(vf, -448.0), 448.0))
        else:
            # Clamp, then round to nearest even with the 1.5 * 2**23 magic number.
            kq = ((tl.minimum(tl.maximum(kf, -127.0), 127.0) + 12582912.0) - 12582912.0).to(tl.int8)
            vq = ((tl.minimum(tl.maximum(vf, -127.0), 127.0) + 12582912.0) - 12582912.0).to(tl.int8)
    else:
        kq = k.to(key_cache_ptr.dtype.element_ty)
        vq = v.to(value_cache_ptr.dtype.element_ty)
    tl.store(key_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d * stride_kcd, kq, mask=mask)
    tl.store(value_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d * stride_vcd, vq, mask=mask)


@triton.jit(do_not_specialize=["num_queries_per_kv", "block_size", "sliding_window", "num_splits", "stride_bts"])
def paged_attention_decode_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (written when not USE_SPLIT)
    part_out_ptr,  # fp32 [num_seqs, num_heads, num_splits, head_dim] (USE_SPLIT)
    part_ml_ptr,  # fp32 [num_seqs, num_heads, num_splits, 2]: running max (log2 units), sum
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int [num_seqs]
    query_start_loc_ptr,  # int [num_seqs + 1]
    k_scale_ptr,  # fp32 [1] or [num_kv_heads] (unused unless KV_QUANT)
    v_scale_ptr,  # fp32 [1] or [num_kv_heads]
    qk_scale,  # softmax scale * log2(e)
    num_queries_per_kv,
    head_dim,
    block_size,
    sliding_window,  # 0: none
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_bts,
    stride_scale_h,
    alibi_ptr,  # fp32 [num_heads]: ALiBi slopes * log2(e) (unused unless USE_ALIBI)
    KV_QUANT: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_ALIBI: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # launched with PDL: wait for the kernel before first
):
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start, is_decode, seq_len, ctx_start, tile_lo, tile_hi = _decode_split_range(
        query_start_loc_ptr, seq_lens_ptr, seq, split, sliding_window, num_splits, BLOCK_N
    )

    g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query head within the group
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    heads = kvh * num_queries_per_kv + g  # [BLOCK_G]
    gmask = g < num_queries_per_kv
    dmask = d < head_dim
    q_ptrs = query_ptr + q_start * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=gmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    scale_s = qk_scale
    if KV_QUANT != 0:
        scale_s = qk_scale * tl.load(k_scale_ptr + kvh * stride_scale_h)

    k_base = key_cache_ptr + kvh * stride_kch + d[None, :] * stride_kcd  # [1, BLOCK_D]
    v_base = value_cache_ptr + kvh * stride_vch + d[None, :] * stride_vcd
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bts

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = ctx_start + tile * BLOCK_N + n  # [BLOCK_N] key positions
        nmask = pos < seq_len
        page = tl.load(bt_base + pos // block_size, mask=nmask, other=0).to(tl.int64)  # [BLOCK_N]
        off = pos % block_size
        kv_mask = nmask[:, None] & dmask[None, :]  # [BLOCK_N, BLOCK_D]
        k = _load_kv_tile(
            k_base + page[:, None] * stride_kcb + off[:, None] * stride_kcs, kv_mask, KV_QUANT, q.dtype
        )  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k)) * scale_s  # [BLOCK_G, BLOCK_N] fp32, log2 units
        if USE_ALIBI:  # slope * (key position - query position), the query at seq_len - 1
            s += (
                tl.load(alibi_ptr + heads, mask=gmask, other=0.0)[:, None] * (pos - seq_len + 1).to(tl.float32)[None, :]
            )
        s = tl.where(nmask[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = _online_softmax_step(s, m_i, l_i)
        v = _load_kv_tile(
            v_base + page[:, None] * stride_vcb + off[:, None] * stride_vcs, kv_mask, KV_QUANT, q.dtype
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if KV_QUANT != 0:
        acc = acc * tl.load(v_scale_ptr + kvh * stride_scale_h)
    if USE_SPLIT:
        row = _split_row(seq, heads, split, num_queries_per_kv, num_splits)  # [BLOCK_G]
        smask = g < tl.where(is_decode, num_queries_per_kv, 0)  # gmask, empty unless decoding
        tl.store(part_out_ptr + row[:, None] * head_dim + d[None, :], acc, mask=smask[:, None] & dmask[None, :])
        tl.store(part_ml_ptr + row * 2, m_i, mask=smask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=smask)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + q_start * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
        omask = (g < tl.where(is_decode, num_queries_per_kv, 0))[:, None] & dmask[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _unpack4_to_f16(w, KV_QUANT: tl.constexpr):
    """int32 words of 4 codes (bytes b0..b3, little-endian) -> 4 fp16 tensors, one per byte.

    Two bytes become two fp16 lanes of one 32-bit word with a handful of 32-bit ops (about
    2.5 integer ops per code instead of ~9 byte-wise). fp8: the value is ``2**-8`` times the
    e4m3 value (exact; the caller folds 256 into the scales). int8: ``1024 + (code ^ 0x80)``
    via the fp16 exponent trick, then minus 1152.
    """
    if KV_QUANT == 1:
        # sign to bit 15 of each lane, the 7 exponent+mantissa bits to bits 7..13
        odd = (w & -2147450880) | ((w >> 1) & 0x3F803F80)  # -2147450880 == 0x80008000: b1 | b3 << 16
        even = ((w << 8) & -2147450880) | ((w << 7) & 0x3F803F80)  # b0 | b2 << 16
    else:
        u = w ^ -2139062144  # -2139062144 == 0x80808080: signed codes -> code + 128
        even = (u & 0x00FF00FF) | 0x64006400  # fp16 1024 + (code + 128), lanes b0 | b2 << 16
        odd = ((u >> 8) & 0x00FF00FF) | 0x64006400
    e0 = even.to(tl.int16).to(tl.float16, bitcast=True)
    e2 = (even >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    e1 = odd.to(tl.int16).to(tl.float16, bitcast=True)
    e3 = (odd >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    if KV_QUANT == 2:
        e0, e1, e2, e3 = e0 - 1152.0, e1 - 1152.0, e2 - 1152.0, e3 - 1152.0
    return e0, e1, e2, e3


@triton.jit(do_not_specialize=["num_queries_per_kv", "block_size", "sliding_window", "num_splits", "stride_bts"])
def paged_attention_decode_packed_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (written when not USE_SPLIT)
    part_out_ptr,  # fp32 [num_seqs, num_heads, num_splits, head_dim] (USE_SPLIT)
    part_ml_ptr,  # fp32 [num_seqs, num_heads, num_splits, 2]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # int32 [num_blocks, block_size, num_kv_heads, head_dim // 4]: 4 fp8 / int8 codes a word
    value_cache_ptr,  # int32 [num_blocks, block_size, num_kv_heads, head_dim // 4]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int [num_seqs]
    query_start_loc_ptr,  # int [num_seqs + 1]
    k_scale_ptr,  # fp32 [1] or [num_kv_heads]
    v_scale_ptr,  # fp32 [1] or [num_kv_heads]
    qk_scale,  # softmax scale * log2(e)
    num_queries_per_kv,
    block_size,
    sliding_window,  # 0: none
    num_splits,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcb,  # in words
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bts,
    stride_scale_h,
    alibi_ptr,  # fp32 [num_heads]: ALiBi slopes * log2(e) (unused unless USE_ALIBI)
    KV_QUANT: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # a power of two >= 64, contiguous in the cache
    USE_ALIBI: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,  # launched with PDL: wait for the kernel before first
):
    """``paged_attention_decode_kernel`` for fp8 / int8 caches read as 32-bit words.

    The head dim is processed as 4 interleaved slices (``d = 4 * c + j``): query slice ``j``
    meets the byte-``j`` codes of each word, so the codes are never re-interleaved; the four
    partial dots add up to the full ``q . k``, and output slice ``j`` is stored to columns
    ``4 * c + j``.
    """
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    BLOCK_C: tl.constexpr = HEAD_DIM // 4
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start, is_decode, seq_len, ctx_start, tile_lo, tile_hi = _decode_split_range(
        query_start_loc_ptr, seq_lens_ptr, seq, split, sliding_window, num_splits, BLOCK_N
    )

    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, BLOCK_C)  # word index within the head
    n = tl.arange(0, BLOCK_N)
    heads = kvh * num_queries_per_kv + g
    gmask = g < num_queries_per_kv
    q_ptrs = query_ptr + q_start * stride_qt + heads[:, None] * stride_qh + 4 * c[None, :]  # [BLOCK_G, BLOCK_C]
    qmask = gmask[:, None]
    # Dots run in the activation dtype: the fp16 code values convert to bf16 exactly.
    q0 = tl.load(q_ptrs, mask=qmask, other=0.0)  # [BLOCK_G, BLOCK_C] columns 4c
    q1 = tl.load(q_ptrs + 1, mask=qmask, other=0.0)  # columns 4c + 1
    q2 = tl.load(q_ptrs + 2, mask=qmask, other=0.0)
    q3 = tl.load(q_ptrs + 3, mask=qmask, other=0.0)
    if DOT_F32:
        q0, q1, q2, q3 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
    code_scale = 256.0 if KV_QUANT == 1 else 1.0
    scale_s = qk_scale * code_scale * tl.load(k_scale_ptr + kvh * stride_scale_h)

    k_base = key_cache_ptr + kvh * stride_kch + c[None, :]  # [1, BLOCK_C]
    v_base = value_cache_ptr + kvh * stride_vch + c[None, :]
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bts

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = ctx_start + tile * BLOCK_N + n  # [BLOCK_N]
        nmask = pos < seq_len
        page = tl.load(bt_base + pos // block_size, mask=nmask, other=0).to(tl.int64)
        off = pos % block_size
        kw = tl.load(
            k_base + (page * stride_kcb + off * stride_kcs)[:, None], mask=nmask[:, None], other=0
        )  # int32 [BLOCK_N, BLOCK_C]
        k0, k1, k2, k3 = _unpack4_to_f16(kw, KV_QUANT)
        s = tl.dot(q0, tl.trans(k0.to(q0.dtype)))
        s = tl.dot(q1, tl.trans(k1.to(q1.dtype)), s)
        s = tl.dot(q2, tl.trans(k2.to(q2.dtype)), s)
        s = tl.dot(q3, tl.trans(k3.to(q3.dtype)), s)  # [BLOCK_G, BLOCK_N]
        s = s * scale_s
        if USE_ALIBI:
            s += (
                tl.load(alibi_ptr + heads, mask=gmask, other=0.0)[:, None] * (pos - seq_len + 1).to(tl.float32)[None, :]
            )
        s = tl.where(nmask[None, :], s, float("-inf"))
        p, alpha, m_new, l_i = _online_softmax_step(s, m_i, l_i)
        vw = tl.load(v_base + (page * stride_vcb + off * stride_vcs)[:, None], mask=nmask[:, None], other=0)
        v0, v1, v2, v3 = _unpack4_to_f16(vw, KV_QUANT)
        pc = p.to(q0.dtype)
        acc0 = tl.dot(pc, v0.to(q0.dtype), acc0 * alpha[:, None])
        acc1 = tl.dot(pc, v1.to(q0.dtype), acc1 * alpha[:, None])
        acc2 = tl.dot(pc, v2.to(q0.dtype), acc2 * alpha[:, None])
        acc3 = tl.dot(pc, v3.to(q0.dtype), acc3 * alpha[:, None])
        m_i = m_new

    v_scale = code_scale * tl.load(v_scale_ptr + kvh * stride_scale_h)
    smask = g < tl.where(is_decode, num_queries_per_kv, 0)  # gmask, empty unless decoding
    if USE_SPLIT:
        row = _split_row(seq, heads, split, num_queries_per_kv, num_splits)
        o_ptrs = part_out_ptr + row[:, None] * HEAD_DIM + 4 * c[None, :]
        norm = tl.full([BLOCK_G], 1.0, dtype=tl.float32) * v_scale
        tl.store(part_ml_ptr + row * 2, m_i, mask=smask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=smask)
    else:
        o_ptrs = out_ptr + q_start * stride_ot + heads[:, None] * stride_oh + 4 * c[None, :]
        norm = v_scale / tl.where(l_i > 0, l_i, 1.0)
    o_ty = o_ptrs.dtype.element_ty
    tl.store(o_ptrs, (acc0 * norm[:, None]).to(o_ty), mask=smask[:, None])
    tl.store(o_ptrs + 1, (acc1 * norm[:, None]).to(o_ty), mask=smask[:, None])
    tl.store(o_ptrs + 2, (acc2 * norm[:, None]).to(o_ty), mask=smask[:, None])
    tl.store(o_ptrs + 3, (acc3 * norm[:, None]).to(o_ty), mask=smask[:, None])


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def paged_attention_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_out_ptr,  # fp32 [num_seqs, num_heads, num_splits, head_dim]
    part_ml_ptr,  # fp32 [num_seqs, num_heads, num_splits, 2]
    query_start_loc_ptr,  # int [num_seqs + 1]
    num_heads,
    head_dim,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL: wait for the kernel before first
):
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    smask = s < tl.where(q_len == 1, num_splits, 0)  # other sequences left their partials unwritten
    dmask = d < head_dim
    row = (seq.to(tl.int64) * num_heads + head) * num_splits + s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + row * 2, mask=smask, other=-1.0e30)  # [BLOCK_S]
    l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - m_max)  # splits that saw no key have m = -1e30 and l = 0: weight 0
    acc = tl.load(part_out_ptr + row[:, None] * head_dim + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0)
    denom = tl.sum(l_part * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    o_ptrs = out_ptr + q_start * stride_ot + head * stride_oh + d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d < tl.where(q_len == 1, head_dim, 0))


@triton.jit
def _prefill_key_tile(
    acc,  # fp32 [BLOCK_M, BLOCK_D]
    m_i,  # fp32 [BLOCK_M]
    l_i,  # fp32 [BLOCK_M]
    q,  # [BLOCK_M, BLOCK_D]
    start,
    hi,
    q_pos,  # [BLOCK_M]
    win_lo,  # [BLOCK_M]
    heads,  # [BLOCK_M]
    row_mask,  # [BLOCK_M]
    k_base,  # [1, BLOCK_D] pointers
    v_base,
    bt_base,
    block_size,
    stride_kcb,
    stride_kcs,
    stride_vcb,
    stride_vcs,
    dmask,  # [BLOCK_D]
    scale_s,
    alibi_ptr,
    KV_QUANT: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key tile ``[start, start + BLOCK_N)`` of a prefill program's online softmax. ``MASKED``:
    the tile crosses the end of the keys, the causal diagonal or a window edge, so every score is
    masked per row; otherwise every key of the tile is visible to every row (no mask work)."""
    pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    if MASKED:
        nmask = pos < hi
        page = tl.load(bt_base + pos // block_size, mask=nmask, other=0).to(tl.int64)
        kv_mask = nmask[:, None] & dmask[None, :]
    else:
        page = tl.load(bt_base + pos // block_size).to(tl.int64)
        kv_mask = dmask[None, :]
    off = pos % block_size
    k = _load_kv_tile(
        k_base + page[:, None] * stride_kcb + off[:, None] * stride_kcs, kv_mask, KV_QUANT, q.dtype
    )  # [BLOCK_N, BLOCK_D]
    s = tl.dot(q, tl.trans(k)) * scale_s  # [BLOCK_M, BLOCK_N]
    if USE_ALIBI:
        s += tl.load(alibi_ptr + heads, mask=row_mask, other=0.0)[:, None] * (pos[None, :] - q_pos[:, None]).to(
            tl.float32
        )
    if MASKED:
        visible = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
        visible = visible & (pos[None, :] > win_lo[:, None])
        s = tl.where(visible, s, float("-inf"))
    p, alpha, m_new, l_i = _online_softmax_step(s, m_i, l_i)
    v = _load_kv_tile(v_base + page[:, None] * stride_vcb + off[:, None] * stride_vcs, kv_mask, KV_QUANT, q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_seqs", "num_queries_per_kv", "block_size", "sliding_window", "stride_bts"])
def paged_attention_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # int [num_seqs]
    query_start_loc_ptr,  # int [num_seqs + 1]
    k_scale_ptr,  # fp32 [1] or [num_kv_heads] (unused unless KV_QUANT)
    v_scale_ptr,  # fp32 [1] or [num_kv_heads]
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    num_queries_per_kv,
    head_dim,
    block_size,
    sliding_window,  # 0: none
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    stride_bts,
    stride_scale_h,
    alibi_ptr,  # fp32 [num_heads]: ALiBi slopes * log2(e) (unused unless USE_ALIBI)
    KV_QUANT: tl.constexpr,
    SKIP_DECODE: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_ALIBI: tl.constexpr = False,
    REVERSE: tl.constexpr = True,
):
    seq, q_block = _prefill_work_item(query_start_loc_ptr, num_seqs, BLOCK_Q, REVERSE)
    kvh = tl.program_id(1)
    q_start, ctx_before, tok, heads, row_mask, lo, hi = _prefill_rows(
        query_start_loc_ptr, seq_lens_ptr, seq, q_block, kvh, num_queries_per_kv, sliding_window,
        SKIP_DECODE, BLOCK_M, BLOCK_Q,
    )  # fmt: skip
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_dim
    q_ptrs = query_ptr + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = ctx_before + tok  # [BLOCK_M]
    # Oldest visible key position minus one; -1 (every key) without a sliding window.
    win_lo = tl.where(sliding_window > 0, q_pos - sliding_window, -1)  # [BLOCK_M]
    scale_s = qk_scale
    if KV_QUANT != 0:
        scale_s = qk_scale * tl.load(k_scale_ptr + kvh * stride_scale_h)

    k_base = key_cache_ptr + kvh * stride_kch + d[None, :] * stride_kcd  # [1, BLOCK_D]
    v_base = value_cache_ptr + kvh * stride_vch + d[None, :] * stride_vcd
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bts

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys before the block's first query position are visible to every row when there is no
    # window: those whole tiles skip the mask; the rest (the diagonal, the end, window edges) mask.
    first_q = ctx_before + q_block * BLOCK_Q
    open_hi = tl.where(sliding_window > 0, lo, lo + (tl.maximum(first_q - lo, 0) // BLOCK_N) * BLOCK_N)
    open_hi = tl.minimum(open_hi, hi)
    for start in range(lo, open_hi, BLOCK_N):
        acc, m_i, l_i = _prefill_key_tile(
            acc, m_i, l_i, q, start, hi, q_pos, win_lo, heads, row_mask, k_base, v_base, bt_base, block_size,
            stride_kcb, stride_kcs, stride_vcb, stride_vcs, dmask, scale_s, alibi_ptr,
            KV_QUANT, USE_ALIBI, False, BLOCK_N,
        )  # fmt: skip
    for start in range(open_hi, hi, BLOCK_N):
        acc, m_i, l_i = _prefill_key_tile(
            acc, m_i, l_i, q, start, hi, q_pos, win_lo, heads, row_mask, k_base, v_base, bt_base, block_size,
            stride_kcb, stride_kcs, stride_vcb, stride_vcs, dmask, scale_s, alibi_ptr,
            KV_QUANT, USE_ALIBI, True, BLOCK_N,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows outside the block: l = 0, not stored
    if KV_QUANT != 0:
        out = out * tl.load(v_scale_ptr + kvh * stride_scale_h)
    o_ptrs = out_ptr + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dmask[None, :])


# ----------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Tile sizes and warps. ``None`` fields are filled from the head dim and the cache dtype."""

    decode_block_n: int | None = None
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # Prefill tiles; None: ``_prefill_launch`` picks by device and the step's longest prompt chunk.
    prefill_block_m: int | None = None
    prefill_block_n: int | None = None
    prefill_num_warps: int | None = None
    prefill_num_stages: int | None = None
    min_split_tokens: int = 256  # no split shorter than this many keys
    decode_packed: bool = True  # fp8 / int8 caches: read 4 codes a 32-bit word (see the packed kernel)


_DEFAULT_CONFIG = AttentionConfig()


def _num_sms(device: torch.device) -> int:
    """SMs of ``device`` (the decode split count aims at two waves of them); 8 off CUDA."""
    return kdevice.sm_count(device, default=8)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_ctx_len: int, num_sms: int, min_split_tokens: int) -> int:
    """Splits per (seq, kv head) so that the decode grid covers ~2 waves of the SMs.

    A power of two (fewer compiled reduce variants), never leaving a split with fewer than
    ``min_split_tokens`` keys of the longest context.
    """
    programs = num_seqs * num_kv_heads
    want = max(1, -(-2 * num_sms // programs))
    cap = max(1, max_ctx_len // min_split_tokens)
    splits = min(want, cap, 64)
    return 1 << (splits.bit_length() - 1) if splits > 1 else 1


def _kv_quant(cache: torch.Tensor) -> int:
    if cache.dtype == torch.float8_e4m3fn:
        return KV_FP8
    if cache.dtype == torch.int8:
        return KV_INT8
    if cache.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return KV_NONE
    raise ValueError(f"unsupported KV cache dtype {cache.dtype}; supported: fp16, bf16, fp32, float8_e4m3fn, int8")


def _kernel_view(cache: torch.Tensor) -> torch.Tensor:
    # fp8 caches travel as bytes: no fp8 type reaches Triton, so nothing needs sm89+.
    return cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache


def _scale_tensor(
    scale: torch.Tensor | float | None, num_kv_heads: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """fp32 scale tensor and its head stride (0: per-layer, 1: per-head)."""
    if scale is None:
        scale = 1.0
    if not isinstance(scale, torch.Tensor):
        return torch.full((1,), float(scale), dtype=torch.float32, device=device), 0
    scale = scale.to(device=device, dtype=torch.float32).reshape(-1).contiguous()
    if scale.numel() == 1:
        return scale, 0
    if scale.numel() != num_kv_heads:
        raise ValueError(f"KV scale must have 1 or num_kv_heads={num_kv_heads} elements, got {scale.numel()}")
    return scale, 1


def _scales(
    quant: int,
    k_scale: torch.Tensor | float | None,
    v_scale: torch.Tensor | float | None,
    num_kv_heads: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fp32 scale tensors for the kernels; unquantized caches pass an fp32 placeholder that is
    never read (``quant_kernels.device.placeholder``: no allocation, no extra launch per call)."""
    if quant == KV_NONE:
        unused = kdevice.placeholder(device, torch.float32)
        return unused, unused, 0
    ks, stride_scale_h = _scale_tensor(k_scale, num_kv_heads, device)
    vs, _ = _scale_tensor(v_scale, num_kv_heads, device)
    return ks, vs, stride_scale_h


def _packed_view(cache: torch.Tensor) -> torch.Tensor | None:
    """The cache as int32 words of 4 codes, when its layout allows (head dim a power of two >= 64,
    contiguous, 4-byte aligned strides); else None."""
    d = cache.shape[-1]
    if d < 64 or d & (d - 1) or cache.stride(-1) != 1 or cache.storage_offset() % 4 or cache.data_ptr() % 16:
        return None
    if any(st % 4 for st in cache.stride()[:-1]):
        return None
    try:
        return cache.view(torch.uint8).view(torch.int32)  # [num_blocks, block_size, num_kv_heads, head_dim // 4]
    except RuntimeError:
        return None


def _check_quant_scales(quant: int, k_scale: object, v_scale: object) -> None:
    if quant == KV_INT8 and (k_scale is None or v_scale is None):
        raise ValueError("an int8 KV cache needs k_scale and v_scale")


# Prefill tiles measured on the H200 (bench/attention_prefill.py --sweep, bench/RESULTS.md, issue 25):
# (BLOCK_M, BLOCK_N, num_warps, num_stages) for chunks of at least / under LONG_PREFILL tokens.
HOPPER_LONG_PREFILL = (128, 128, 8, 3)
HOPPER_SHORT_PREFILL = (128, 32, 4, 2)
LONG_PREFILL = 512
HOPPER_SHARED = 200 * 1024  # the long tiles keep ~160 KB of K/V stages in shared memory


def _prefill_launch(
    cfg: AttentionConfig,
    group: int,
    head_dim: int,
    max_query_len: int | None = None,
    device: torch.device | None = None,
) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_Q, BLOCK_N, num_warps, num_stages)`` of a prefill launch: ``BLOCK_M`` rows are
    ``BLOCK_Q`` tokens times the ``group`` query heads of one KV head. Head dims up to 128 on a card
    with Hopper's shared memory take the measured tiles (given ``max_query_len``) unless
    ``QSERVE_PREFILL_TILES=earlier`` asks for the earlier ones; elsewhere (Ampere,
    Ada, the int4 kernel, CPU) the earlier tiles: 64 rows, 64 keys (32 past head dim 128), 8 warps
    past head dim 64 (no spills on sm80), 2 stages. Fields of ``cfg`` that are set win."""
    tuned = None
    shared = kdevice.max_shared(device) if device is not None else None
    measured = os.environ.get("QSERVE_PREFILL_TILES", "h200") != "earlier"
    if measured and max_query_len is not None and head_dim <= 128 and shared is not None and shared >= HOPPER_SHARED:
        tuned = HOPPER_LONG_PREFILL if max_query_len >= LONG_PREFILL else HOPPER_SHORT_PREFILL
    m, n, w, st = tuned or (64, 32 if head_dim > 128 else 64, 8 if head_dim > 64 else 4, 2)
    block_m = max(cfg.prefill_block_m or m, triton.next_power_of_2(group))
    block_n = cfg.prefill_block_n or n
    return block_m, block_m // group, block_n, cfg.prefill_num_warps or w, cfg.prefill_num_stages or st


def prefill_grid_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs on the flat prefill grid axis 0 (see ``_prefill_work_item``): enough for every
    query block of any split of ``num_tokens`` over ``num_seqs`` sequences, from host integers only."""
    return num_tokens // block_q + num_seqs


def _decode_num_splits(
    cfg: AttentionConfig,
    num_splits: int | None,
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    window: int,
    device: torch.device,
) -> int:
    """The caller's ``num_splits``, else ``choose_num_splits`` for the visible context."""
    if num_splits is not None:
        return num_splits
    ctx = min(max_seq_len, window) if window else max_seq_len
    return choose_num_splits(num_seqs, num_kv_heads, ctx, _num_sms(device), cfg.min_split_tokens)


def _split_workspace(
    out: torch.Tensor, num_seqs: int, num_heads: int, num_splits: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(part_out [num_seqs, num_heads, num_splits, head_dim], part_ml [..., 2])`` for a
    split decode; with one split, an fp32 placeholder twice (never read)."""
    if num_splits == 1:
        unused = kdevice.placeholder(out.device, torch.float32)
        return unused, unused
    part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device)
    part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=out.device)  # (max, sum)
    return part_out, part_ml


def _reduce_splits(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_ml: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_seqs: int,
    num_heads: int,
    head_dim: int,
    num_splits: int,
) -> None:
    """Combine the split decode partials into ``out`` (``paged_attention_reduce_kernel``)."""
    paged_attention_reduce_kernel[(num_seqs, num_heads)](
        out,
        part_out,
        part_ml,
        query_start_loc,
        num_heads,
        head_dim,
        num_splits,
        *out.stride(),
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=2 if head_dim <= 128 else 4,
        **launch_options(out.device),
    )


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # int [num_tokens]; negative: skip
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write new keys and values into their cache slots (quantizing for fp8 / int8 caches)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = _kv_quant(key_cache)
    _check_quant_scales(quant, k_scale, v_scale)
    ks, vs, stride_scale_h = _scales(quant, k_scale, v_scale, num_kv_heads, key.device)
    kc, vc = _kernel_view(key_cache), _kernel_view(value_cache)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    store_kv_kernel[(num_tokens,)](
        key,
        value,
        kc,
        vc,
        slot_mapping,
        ks,
        vs,
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        *key.stride(),
        *value.stride(),
        *kc.stride(),
        *vc.stride(),
        stride_scale_h,
        KV_QUANT=quant,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
        **launch_options(key.device),
    )


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
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    alibi_slopes: torch.Tensor | None = None,  # float32 [num_heads]
) -> torch.Tensor:
    """Same contract as ``reference.paged_attention`` (+ KV scales, ALiBi slopes); returns ``out``.

    ``max_query_len == 1``: split-KV decode only. Otherwise the prefill kernel, plus (with
    several sequences) the decode kernel for the sequences that have one new token. A split decode
    is followed by the reduce launch.
    """
    cfg = config or _DEFAULT_CONFIG
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    block_size = key_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0 or num_seqs == 0:
        return out
    quant = _kv_quant(key_cache)
    _check_quant_scales(quant, k_scale, v_scale)
    ks, vs, stride_scale_h = _scales(quant, k_scale, v_scale, num_kv_heads, query.device)
    kc, vc = _kernel_view(key_cache), _kernel_view(value_cache)
    window = int(sliding_window) if sliding_window else 0
    qk_scale = float(scale) * LOG2E
    block_d = triton.next_power_of_2(head_dim)
    use_alibi = alibi_slopes is not None
    # [num_heads] in log2 units; without ALiBi an fp32 placeholder (never read)
    alibi = (
        (alibi_slopes.float() * LOG2E).contiguous() if use_alibi else kdevice.placeholder(query.device, torch.float32)
    )
    cache_args = (*kc.stride(), *vc.stride(), block_tables.stride(0), stride_scale_h, alibi)

    run_decode = max_query_len == 1 or num_seqs > 1
    run_prefill = max_query_len > 1
    if run_prefill:
        block_m, block_q, block_n, prefill_warps, prefill_stages = _prefill_launch(
            cfg, group, head_dim, max_query_len, query.device
        )
        grid = (prefill_grid_blocks(num_tokens, num_seqs, block_q), num_kv_heads)
        paged_attention_prefill_kernel[grid](
            out,
            query,
            kc,
            vc,
            block_tables,
            seq_lens,
            query_start_loc,
            ks,
            vs,
            qk_scale,
            num_seqs,
            group,
            head_dim,
            block_size,
            window,
            *query.stride(),
            *out.stride(),
            *cache_args,
            KV_QUANT=quant,
            USE_ALIBI=use_alibi,
            REVERSE=True,
            SKIP_DECODE=run_decode,
            DOT_F32=_INTERPRET,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=block_n,
            BLOCK_D=block_d,
            num_warps=prefill_warps,
            num_stages=prefill_stages,
        )
    if run_decode:
        num_splits = _decode_num_splits(cfg, num_splits, num_seqs, num_kv_heads, max_seq_len, window, query.device)
        block_n = cfg.decode_block_n or (64 if quant == KV_NONE or block_d > 128 else 128)
        if block_d > 128:
            block_n = min(block_n, 32)
        use_split = num_splits > 1
        part_out, part_ml = _split_workspace(out, num_seqs, num_heads, num_splits, head_dim)
        packed = None
        if quant != KV_NONE and cfg.decode_packed and query.stride(2) == 1 and out.stride(2) == 1:
            kp, vp = _packed_view(key_cache), _packed_view(value_cache)
            packed = (kp, vp) if kp is not None and vp is not None else None
        common = dict(
            KV_QUANT=quant,
            USE_ALIBI=use_alibi,
            USE_SPLIT=use_split,
            DOT_F32=_INTERPRET,
            BLOCK_G=max(16, triton.next_power_of_2(group)),
            BLOCK_N=block_n,
            num_warps=cfg.decode_num_warps,
            num_stages=cfg.decode_num_stages,
            **launch_options(out.device),
        )
        grid = (num_seqs, num_kv_heads, num_splits)
        if packed is not None:
            kp, vp = packed
            paged_attention_decode_packed_kernel[grid](
                out,
                part_out,
                part_ml,
                query,
                kp,
                vp,
                block_tables,
                seq_lens,
                query_start_loc,
                ks,
                vs,
                qk_scale,
                group,
                block_size,
                window,
                num_splits,
                query.stride(0),
                query.stride(1),
                out.stride(0),
                out.stride(1),
                *kp.stride()[:3],
                *vp.stride()[:3],
                block_tables.stride(0),
                stride_scale_h,
                alibi,
                HEAD_DIM=head_dim,
                **common,
            )
        else:
            paged_attention_decode_kernel[grid](
                out,
                part_out,
                part_ml,
                query,
                kc,
                vc,
                block_tables,
                seq_lens,
                query_start_loc,
                ks,
                vs,
                qk_scale,
                group,
                head_dim,
                block_size,
                window,
                num_splits,
                *query.stride(),
                *out.stride(),
                *cache_args,
                BLOCK_D=block_d,
                **common,
            )
        if use_split:
            _reduce_splits(out, part_out, part_ml, query_start_loc, num_seqs, num_heads, head_dim, num_splits)
    return out


def decode_kv_bytes(num_seqs: int, ctx_len: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step must read (the bandwidth floor's numerator)."""
    itemsize = torch.empty((), dtype=cache_dtype).element_size()
    return 2 * num_seqs * ctx_len * num_kv_heads * head_dim * itemsize


__all__ = [
    "AttentionConfig",
    "FP8_E4M3_MAX",
    "INT8_MAX",
    "choose_num_splits",
    "decode_kv_bytes",
    "paged_attention",
    "store_kv",
]
