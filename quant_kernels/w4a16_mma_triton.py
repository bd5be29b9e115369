"""Triton W4A16 / W8A16 GEMM on weights pre-shuffled to the MMA A-operand order (swap-AB).

Knows: the MMA-operand layout of ``quant_kernels.repack.MmaQuantWeight`` (int32 words
``[N_pad/4, K_pad*4/vpw]``, one thread's A-fragment values for a 64-wide k chunk contiguous), how
to tile it, and which launch serves which ``(M, K, N)``. Must not know: models, checkpoint
formats, engines. Imported lazily by ``quant_kernels.ops`` on CUDA (and by the CPU tests under
TRITON_INTERPRET=1).

``w4a16_mma_kernel`` computes ``out[M, N] = x[:, perm] @ dequant(W) + bias`` as
``(W^T x^T)^T``: the dequantized ``[BLOCK_N, BLOCK_K]`` weight tile is the MMA's A operand and
stays in registers (wgmma on sm90, mma.sync on sm80-89); the activations are the B operand.
Per K-tile a program loads the words with 16-byte loads (whole 128-byte lines per 8 lanes),
turns each word into fp16/bf16 ``q - 2**(bits-1)`` with ``lop3`` + one packed subtract per two
values (exact), and undoes the load-time shuffle with ``reshape``/``permute`` only, which the
compiler resolves to no data movement (tests/kernels/test_w4a16_ptx.py checks the PTX for
shared-memory stores). Scales: when a K-tile lies in one group and the config says so, once
per tile on the fp32 partial (``acc += dot(q, x^T) * s``: cheapest at decode); else on the weight
values (``scale_w``; always when a tile holds several groups). Either way each tile's MMAs finish
before the next tile is dequantized: MMAs chained on one accumulator and left in flight across the
loop's back edge (what ``tl.dot(a, b, acc)`` gets from Triton's pipeliner) had ptxas reuse the
registers of their in-register A operand for the next tile while the wgmma still read them, on
sm90: wrong output from run to run (bench/RESULTS.md; tests/kernels/test_w4a16_sass.py reads the
SASS for it). Scales and
zeros are 2 bytes per thread, too narrow for the pipeliner's cp.async path, so the kernel loads
them one K-tile ahead into registers itself (``prefetch``; loaded at use they cost one DRAM
latency per K-tile: the decode kernel was latency-bound on them). Asymmetric zeros are
subtracted from the integer values in registers (``q - z`` is exact in fp16/bf16): a rowsum-of-x
correction instead was measured in the PTX to put the x reduction through shared memory. The
zeros arrive as fp16 ``z - 2**(bits-1)`` (``MmaQuantWeight.zeros``): a uint8 load anywhere in the
A operand's inputs makes Triton pick an 8-bit-wide operand (kWidth 8) on sm80-89, which no longer
matches the stored order and brings the shared-memory round trip back (seen in the sm86 PTX).
Split-K partials go to an fp32 workspace; the last program of a tile (atomic counter) sums them, adds bias, writes the output and resets its counter: one launch, no memset, no host
work, so the call is safe to capture in a CUDA graph once compiled.

``w4a16_mma_streamk_kernel`` is the same product on a stream-K grid (``MmaConfig.stream_k``
programs per SM): the (output tile, K-tile) iterations are cut into one equal contiguous range per
program, so every SM works to the end whatever the tile count; tiles shared by several programs
meet in the same workspace-and-counter reduction as split-K. Both kernels share the K-range loop
(``_accumulate``) and the tile write (``_write_tile``). It is a sweep candidate, not in the built-in
dispatch, until an H200 run decides (bench/RESULTS.md).

``mma_dequant_kernel`` writes the dense ``[K, N]`` weight (input row order), or a column slab of
it, for the large-M path that hands the product to cuBLAS where that measured faster
(``select_config``); slab by slab through one L2-sized buffer (``chunk_n``) the fp16 weight need
not round-trip through DRAM.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quant_kernels import device as kdevice
from quant_kernels import int4_values_asm
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.pdl import use_pdl
from quant_kernels.repack import MMA_PAD_N, MmaQuantWeight, mma_kwidth, mma_shuffle
from quant_kernels.switches import env_switch

# Under TRITON_INTERPRET=1 (CPU tests) inline PTX cannot run and bf16 dots are unreliable in
# Triton's interpreter, so the launcher passes FAST=False / DOT_F32=True there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# ----------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------


# The 8 values of a 4-bit word as ``q - 8``: the PTX of ``_values_fast4`` (quant_kernels.int4_values_asm,
# shared with the Gluon kernel).
BF16_VALUES4_ASM = tl.constexpr(int4_values_asm.BF16_VALUES4)
FP16_VALUES4_ASM = tl.constexpr(int4_values_asm.FP16_VALUES4)


@triton.jit
def _values_fast4(w, IS_BF16: tl.constexpr):
    """The 8 values of each 4-bit word as fp16/bf16 ``q - 8``, in word-value order v0..v7.

    Value ``2i`` is field ``i``, value ``2i + 1`` field ``i + 4``: ``(w >> 4i) & 0x000F000F |
    magic`` is their half2 ``magic + q`` (fp16 1024, bf16 128: ulp 1) and one packed subtract
    (fp16) or fma (bf16, no sub.bf16x2 before sm90) removes ``magic + 8``. Exact. fp16 takes the
    odd fields without their shift (``FP16_VALUES4_ASM``).
    """
    if IS_BF16:
        return tl.inline_asm_elementwise(
            BF16_VALUES4_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
        )
    else:
        return tl.inline_asm_elementwise(
            FP16_VALUES4_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(tl.float16,) * 8, is_pure=True, pack=1
        )


@triton.jit
def _values_fast8(w):
    """The 4 values of each 8-bit word as fp16 ``q - 128`` (v0..v3 = bytes 0, 2, 1, 3). Exact."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t0, t1, s0, z; mov.b32 z, 0x64806480; "
        "lop3.b32 t0, $4, 0x00ff00ff, 0x64006400, 0xea; "
        "shr.u32 s0, $4, 8; lop3.b32 t1, s0, 0x00ff00ff, 0x64006400, 0xea; "
        "sub.f16x2 t0, t0, z; sub.f16x2 t1, t1, z; "
        "mov.b32 {$0, $1}, t0; mov.b32 {$2, $3}, t1; }",
        "=h,=h,=h,=h,r",
        [w],
        dtype=(tl.float16,) * 4,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _value_slow(w, field: tl.constexpr, BITS: tl.constexpr, dtype: tl.constexpr):
    """One field of every word as ``q - 2**(bits-1)`` without PTX (interpreter, 8-bit bf16)."""
    q = (w.to(tl.uint32, bitcast=True) >> (BITS * field)) & ((1 << BITS) - 1)
    return (q.to(tl.int32) - (1 << (BITS - 1))).to(tl.float32).to(dtype)


@triton.jit
def _join8(a0, a1, a2, a3, a4, a5, a6, a7):
    """[R, C] x 8 -> [R, C * 8] with a_j at position j (leaves joined in bit-reversed order)."""
    t = tl.join(
        tl.join(tl.join(a0, a4), tl.join(a2, a6)),
        tl.join(tl.join(a1, a5), tl.join(a3, a7)),
    )  # [R, C, 2, 2, 2]: index (b0, b1, b2) holds a_(4*b0 + 2*b1 + b2)
    return tl.reshape(t, (a0.shape[0], a0.shape[1] * 8))


@triton.jit
def _join4(a0, a1, a2, a3):
    """[R, C] x 4 -> [R, C * 4] with a_j at position j."""
    t = tl.join(tl.join(a0, a2), tl.join(a1, a3))  # [R, C, 2, 2]: (b0, b1) holds a_(2*b0 + b1)
    return tl.reshape(t, (a0.shape[0], a0.shape[1] * 4))


@triton.jit
def _dequant_words(w, BITS: tl.constexpr, dtype: tl.constexpr, FAST: tl.constexpr):
    """int32 words [R, C] -> values ``q - 2**(bits-1)`` [R, C * vpw] in stored order."""
    IS_BF16: tl.constexpr = dtype == tl.bfloat16
    if BITS == 4:
        if FAST:
            v0, v1, v2, v3, v4, v5, v6, v7 = _values_fast4(w, IS_BF16)
        else:
            v0 = _value_slow(w, 0, BITS, dtype)
            v1 = _value_slow(w, 4, BITS, dtype)
            v2 = _value_slow(w, 1, BITS, dtype)
            v3 = _value_slow(w, 5, BITS, dtype)
            v4 = _value_slow(w, 2, BITS, dtype)
            v5 = _value_slow(w, 6, BITS, dtype)
            v6 = _value_slow(w, 3, BITS, dtype)
            v7 = _value_slow(w, 7, BITS, dtype)
        return _join8(v0, v1, v2, v3, v4, v5, v6, v7)
    else:
        if FAST:
            v0, v1, v2, v3 = _values_fast8(w)
        else:
            v0 = _value_slow(w, 0, BITS, dtype)
            v1 = _value_slow(w, 2, BITS, dtype)
            v2 = _value_slow(w, 1, BITS, dtype)
            v3 = _value_slow(w, 3, BITS, dtype)
        return _join4(v0, v1, v2, v3)


@triton.jit
def _unshuffle(v, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KW: tl.constexpr):
    """Stored [BLOCK_N/4, BLOCK_K*4] -> [BLOCK_N, BLOCK_K] (inverse of repack.mma_shuffle)."""
    v = tl.reshape(v, (BLOCK_N // 16, 4, BLOCK_K // 64, 2, 4, 8 // KW, 2, 2, KW))
    v = tl.permute(v, (0, 7, 1, 3, 2, 5, 6, 4, 8))  # (blk16, rh, ga, gl, kc, s, h, t, e)
    return tl.reshape(v, (BLOCK_N, BLOCK_K))


@triton.jit
def _weight_tile(qw_ptr, rows, kt, stride_qr, BITS, KW, BLOCK_N, BLOCK_K, dtype, FAST):
    """Load and dequantize one [BLOCK_N, BLOCK_K] weight tile (values q - 2**(bits-1))."""
    VPW: tl.constexpr = 32 // BITS
    WCOLS: tl.constexpr = BLOCK_K * 4 // VPW
    cols = kt * WCOLS + tl.arange(0, WCOLS)  # [WCOLS]
    # Padded storage: no masks. Weights are read once: keep them out of L2's way.
    w = tl.load(qw_ptr + rows[:, None] * stride_qr + cols[None, :], eviction_policy="evict_first")
    return _unshuffle(_dequant_words(w, BITS, dtype, FAST), BLOCK_N, BLOCK_K, KW)


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    """Bulk-prefetch ``nbytes`` (a multiple of 16) at each 16-byte-aligned address into L2
    (sm90 ``cp.async.bulk.prefetch.L2``): no data reaches the program, nothing is written."""
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r",
        [ptrs, tl.full(ptrs.shape, nbytes, tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _k_share(pid_k, split_k, K, BLOCK_K: tl.constexpr):
    """``(kt_start, kt_end)``: program ``pid_k``'s K-tiles of ``split_k`` shares, ``cdiv(K-tiles,
    split_k)`` from ``pid_k`` times that (the last shares may be short or empty: ``kt_end <= kt_start``)."""
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(num_k_tiles, split_k)
    kt_start = pid_k * per
    return kt_start, tl.minimum(kt_start + per, num_k_tiles)


@triton.jit
def _prefetch_k_tiles(qw_ptr, rows, stride_qr, kt_start, count, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Before a PDL wait: ``count`` K-tiles from ``kt_start`` of the storage ``rows`` of a weight in the
    MMA-operand order into L2 (``_prefetch_l2``; one bulk prefetch a row)."""
    WORDS: tl.constexpr = BLOCK_K * 4 // (32 // BITS)  # int32 words of one K-tile per storage row
    _prefetch_l2(qw_ptr + rows * stride_qr + kt_start * WORDS, count * (WORDS * 4))


@triton.jit
def _group_params(
    scales_ptr,
    zeros_ptr,
    kt,
    offs_n,
    mask_n,
    K,
    group_size,
    stride_sg,
    stride_zg,
    HAS_ZEROS: tl.constexpr,
    NG: tl.constexpr,
    SCALE_W: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Scales and zeros of K-tile ``kt``: ``[BN]`` each when the tile lies in one group and the
    scales go on the partial, else ``[BN, NG]``: one per ``BLOCK_K // NG`` rows of the tile, which is
    the group size when groups divide the tile, or the step between group boundaries when they do not
    (groups of 48 or 80 rows: a 128-row tile in 8 runs of 16, each inside one group). Without zeros
    the second value is a dummy."""
    k0 = kt * BLOCK_K
    if NG == 1 and not SCALE_W:
        g = k0 // group_size
        s = tl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)  # [BN]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + g * stride_zg + offs_n, mask=mask_n, other=0.0)  # [BN]
        else:
            z = s
    else:
        if NG == 1 or BLOCK_K // NG == group_size:  # the tile lies in one group or holds whole groups
            offs_g = k0 // group_size + tl.arange(0, NG)  # [NG]
            mask_g = mask_n[:, None] & (offs_g * group_size < K)[None, :]  # the last tile may hold fewer groups
        else:  # runs of BLOCK_K // NG rows, each inside one group (consecutive runs may share it)
            starts = k0 + tl.arange(0, NG) * (BLOCK_K // NG)  # [NG] each run's first row
            offs_g = starts // group_size  # [NG]
            mask_g = mask_n[:, None] & (starts < K)[None, :]  # runs past K (in the last tile) load nothing
        s = tl.load(scales_ptr + offs_g[None, :] * stride_sg + offs_n[:, None], mask=mask_g, other=0.0)  # [BN, NG]
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + offs_g[None, :] * stride_zg + offs_n[:, None], mask=mask_g, other=0.0)  # [BN, NG]
        else:
            z = s
    return s, z


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _accumulate(
    x_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    perm_ptr,
    offs_m,  # [BLOCK_M] rows of x
    offs_n,  # [BLOCK_N] output columns
    rows,  # [BLOCK_N / 4] storage rows of the weight
    mask_m,
    mask_n,
    kt_start,
    kt_end,
    M,
    K,
    group_size: tl.constexpr,
    stride_xm,
    stride_qr,
    stride_sg,
    stride_zg,
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    NG: tl.constexpr,
    SCALE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """``(W^T x^T)`` over K-tiles ``kt_start .. kt_end - 1`` of one output tile: fp32 [BLOCK_N, BLOCK_M]."""
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # The group parameters of a K-tile are 2-byte-per-thread loads, too narrow for the pipeliner's
    # cp.async path, so each used to be a synchronous global load right before its use: one DRAM
    # latency per K-tile on the critical path. They are loaded one tile ahead into registers (two
    # ahead made Triton 3.6's pipeliner drop the weight tiles' multi-buffering: 4 KB shared, not 28).
    kt_last = kt_end - 1  # a split past the last tile runs no iteration: clamp its loads in range
    s_cur, z_cur = _group_params(
        scales_ptr,
        zeros_ptr,
        tl.minimum(kt_start, kt_last),
        offs_n,
        mask_n,
        K,
        group_size,
        stride_sg,
        stride_zg,
        HAS_ZEROS,
        NG,
        SCALE_W,
        BLOCK_N,
        BLOCK_K,
    )
    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        # With the prefetch, the next tile's (the last tile re-reads its own: an L2 hit); else its own.
        kt_params = tl.minimum(kt + 1, kt_last) if PREFETCH else kt
        s_new, z_new = _group_params(
            scales_ptr,
            zeros_ptr,
            kt_params,
            offs_n,
            mask_n,
            K,
            group_size,
            stride_sg,
            stride_zg,
            HAS_ZEROS,
            NG,
            SCALE_W,
            BLOCK_N,
            BLOCK_K,
        )
        if not PREFETCH:
            s_cur, z_cur = s_new, z_new
        wt = _weight_tile(qw_ptr, rows, kt, stride_qr, BITS, KW, BLOCK_N, BLOCK_K, dtype, FAST)  # [BN, BK]
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        if EVEN_K:  # K a multiple of BLOCK_K (every real layer's): no K mask to build per tile
            mask_x = mask_m[:, None]  # [BLOCK_M, 1]
            src = tl.load(perm_ptr + offs_k) if HAS_PERM else offs_k
        else:
            mask_k = offs_k < K
            mask_x = mask_m[:, None] & mask_k[None, :]  # [BLOCK_M, BLOCK_K]
            src = tl.load(perm_ptr + offs_k, mask=mask_k, other=0) if HAS_PERM else offs_k
        xk = tl.load(x_ptr + offs_m[:, None] * stride_xm + src[None, :], mask=mask_x, other=0.0)  # [BLOCK_M, BLOCK_K]
        if NG == 1 and not SCALE_W:
            s = s_cur.to(tl.float32)  # [BN]
            if HAS_ZEROS:  # q - z, exact in fp16/bf16; the [BN] zeros load lands in the A layout directly
                if DOT_F32:  # interpreter: bf16 arithmetic there is unreliable
                    wt = wt.to(tl.float32) - z_cur.to(tl.float32)[:, None]
                else:
                    wt = wt - z_cur.to(dtype)[:, None]
            if DOT_F32:
                part = tl.dot(wt.to(tl.float32), tl.trans(xk.to(tl.float32)))  # [BN, BM]
            else:
                part = tl.dot(wt, tl.trans(xk))  # [BN, BM]
            acc += part * s[:, None]
        else:
            G: tl.constexpr = BLOCK_K // NG  # columns of the tile per scale (_group_params)
            wdt = tl.float32 if DOT_F32 else dtype  # interpreter: bf16 arithmetic there is unreliable
            wt = wt.to(wdt)
            if HAS_ZEROS:
                zf = z_cur.to(wdt)  # [BN, NG]
                wt = wt - tl.reshape(tl.broadcast_to(zf[:, :, None], (BLOCK_N, NG, G)), (BLOCK_N, BLOCK_K))
            s_full = tl.reshape(tl.broadcast_to(s_cur.to(wdt)[:, :, None], (BLOCK_N, NG, G)), (BLOCK_N, BLOCK_K))
            # [BN, BK] scaled weights: the product of exact (q - z) and s, rounded once as the reference does
            # Not ``tl.dot(.., acc)``: Triton would chain the MMAs on acc and leave them in flight into
            # the next iteration, and ptxas then reuses the registers of their in-register A operand
            # for the next tile's dequant while the wgmma still reads them (on sm90: the race behind
            # the wrong outputs in bench/RESULTS.md; tests/kernels/test_w4a16_sass.py checks the SASS).
            # The fma (which Triton does not fold into the dot) makes each tile's MMAs finish first.
            if DOT_F32:
                acc = tl.fma(tl.dot(wt * s_full, tl.trans(xk.to(tl.float32))), 1.0, acc)
            else:
                acc = tl.fma(tl.dot(wt * s_full, tl.trans(xk)), 1.0, acc)
        if PREFETCH:
            s_cur, z_cur = s_new, z_new

    return acc


@triton.jit
def _store_tile(out_t, out_ptrs, bias_ptr, offs_n, mask_n, mask_mn, HAS_BIAS: tl.constexpr):
    """Write a whole tile's fp32 product ``[BLOCK_M, BLOCK_N]`` (plus the bias) to the output."""
    if HAS_BIAS:
        out_t += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptrs, out_t.to(out_ptrs.dtype.element_ty), mask=mask_mn)


@triton.jit
def _share_tile(
    out_t,  # fp32 [BLOCK_M, BLOCK_N]: this program's partial
    out_ptrs,
    bias_ptr,
    ws_ptr,  # fp32 workspace
    cnt_ptr,  # int32 arrival counters
    offs_m,
    offs_n,
    mask_n,
    mask_mn,
    stride_wsk,
    stride_wsm,
    slot,
    n_slots,
    tile_id,
    HAS_BIAS: tl.constexpr,
):
    """One of ``n_slots`` partials of a tile: into the workspace; the last to arrive (atomic
    counter) sums them, adds the bias, writes the output and resets the counter."""
    BLOCK_M: tl.constexpr = out_t.shape[0]
    BLOCK_N: tl.constexpr = out_t.shape[1]
    ws_tile = ws_ptr + offs_m[:, None] * stride_wsm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    tl.store(ws_tile + slot * stride_wsk, out_t, mask=mask_mn)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
    if arrived == n_slots - 1:  # last program of this tile: reduce, add bias, write, reset
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sk in range(0, n_slots):
            total += tl.load(ws_tile + sk * stride_wsk, mask=mask_mn, other=0.0, cache_modifier=".cg")
        _store_tile(total, out_ptrs, bias_ptr, offs_n, mask_n, mask_mn, HAS_BIAS)
        tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def _write_tile(
    acc,  # fp32 [BLOCK_N, BLOCK_M]
    out_ptr,
    bias_ptr,
    ws_ptr,  # fp32 workspace (a never-read placeholder unless USE_SPLIT or SEGMENTED)
    cnt_ptr,  # int32 counters (likewise)
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    stride_om,
    stride_wsk,
    stride_wsm,
    slot,  # this program's workspace slot for the tile
    n_slots,  # programs that contribute to the tile
    tile_id,  # the tile's arrival counter
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    SEGMENTED: tl.constexpr = False,  # n_slots varies by tile (stream-K): 1 means a direct write
):
    """Write a tile's product: directly, or as one of ``n_slots`` partials (``_share_tile``).
    Which of the two a launch compiles is chosen by constexprs alone (the split-K grid by
    ``USE_SPLIT``; the stream-K grid, whose tiles are shared or not at run time, compiles both):
    the plain grid never compiles the atomics at all."""
    out_t = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask_mn = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if SEGMENTED:
        if n_slots == 1:
            _store_tile(out_t, out_ptrs, bias_ptr, offs_n, mask_n, mask_mn, HAS_BIAS)
        else:
            _share_tile(
                out_t, out_ptrs, bias_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, mask_n, mask_mn,
                stride_wsk, stride_wsm, slot, n_slots, tile_id, HAS_BIAS,
            )  # fmt: skip
    elif USE_SPLIT:
        _share_tile(
            out_t, out_ptrs, bias_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, mask_n, mask_mn,
            stride_wsk, stride_wsm, slot, n_slots, tile_id, HAS_BIAS,
        )  # fmt: skip
    else:
        _store_tile(out_t, out_ptrs, bias_ptr, offs_n, mask_n, mask_mn, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def w4a16_mma_kernel(
    x_ptr,  # [M, K] fp16 / bf16
    qw_ptr,  # int32 [N_pad / 4, K_pad * 4 / vpw], MMA-operand order (repack.mma_shuffle)
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # fp16 [num_groups, N]: z - 2**(bits-1) (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    bias_ptr,  # [N] (unused when not HAS_BIAS)
    out_ptr,  # [M, N]
    ws_ptr,  # fp32 [split_k, M, N] split-K partials (unused when not USE_SPLIT)
    cnt_ptr,  # int32 [>= tiles] zero-initialised arrival counters (unused when not USE_SPLIT)
    M,
    N,
    K,
    group_size: tl.constexpr,  # a compile-time constant: the per-tile group index is a shift, not a
    # runtime integer division (~27 instructions per K-tile in the sm90 SASS of the decode loop)
    split_k,
    stride_xm,  # x's K stride is 1 (the launcher makes it so): contiguous, vectorized loads
    stride_qr,
    stride_sg,  # scales, zeros and out have unit N stride (the launcher makes it so)
    stride_zg,
    stride_om,
    stride_wsk,
    stride_wsm,
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NG: tl.constexpr,  # groups per K-tile (1: the tile lies in one group)
    SCALE_W: tl.constexpr,  # scale the weight values, not the partial (always when NG > 1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    FAST: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr = True,  # group parameters loaded one K-tile ahead (else at use)
    EVEN_K: tl.constexpr = False,  # K is a multiple of BLOCK_K: no K masks
    USE_PDL: tl.constexpr = False,  # launched with PDL (quant_kernels.pdl): prefetch, then wait
    PDL_TILES: tl.constexpr = 0,  # K-tiles of weights to prefetch into L2 before the wait
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)  # [BLOCK_N / 4] storage rows
    mask_n = offs_n < N
    mask_m = offs_m < M
    kt_start, kt_end = _k_share(pid_k, split_k, K, BLOCK_K)
    if USE_PDL:
        # The weights are read-only for the whole stream: their first tiles start streaming into
        # L2 while the kernel before still runs. Everything else (x, the workspace, the counters,
        # the output) only after the wait.
        if PDL_TILES > 0 and kt_end > kt_start:
            _prefetch_k_tiles(
                qw_ptr, rows, stride_qr, kt_start, tl.minimum(kt_end - kt_start, PDL_TILES), BITS, BLOCK_K
            )
        gdc_wait()
        gdc_launch_dependents()

    acc = _accumulate(
        x_ptr,
        qw_ptr,
        scales_ptr,
        zeros_ptr,
        perm_ptr,
        offs_m,
        offs_n,
        rows,
        mask_m,
        mask_n,
        kt_start,
        kt_end,
        M,
        K,
        group_size,
        stride_xm,
        stride_qr,
        stride_sg,
        stride_zg,
        BITS,
        KW,
        HAS_ZEROS,
        HAS_PERM,
        NG,
        SCALE_W,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        FAST,
        DOT_F32,
        PREFETCH,
        EVEN_K,
    )
    _write_tile(
        acc,
        out_ptr,
        bias_ptr,
        ws_ptr,
        cnt_ptr,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        stride_om,
        stride_wsk,
        stride_wsm,
        pid_k,
        split_k,
        pid_m * tl.num_programs(0) + pid_n,
        HAS_BIAS,
        USE_SPLIT,
    )


@triton.jit(do_not_specialize=["M"])
def w4a16_mma_streamk_kernel(
    x_ptr,  # [M, K] fp16 / bf16
    qw_ptr,  # int32 [N_pad / 4, K_pad * 4 / vpw], MMA-operand order (repack.mma_shuffle)
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # fp16 [num_groups, N]: z - 2**(bits-1) (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    bias_ptr,  # [N] (unused when not HAS_BIAS)
    out_ptr,  # [M, N]
    ws_ptr,  # fp32 [slots, M, N]: partials of the tiles a program shares with others
    cnt_ptr,  # int32 [>= tiles] zero-initialised arrival counters
    M,
    N,
    K,
    group_size: tl.constexpr,
    stride_xm,
    stride_qr,
    stride_sg,
    stride_zg,
    stride_om,
    stride_wsk,
    stride_wsm,
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NG: tl.constexpr,
    SCALE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
    DOT_F32: tl.constexpr,
    PREFETCH: tl.constexpr = True,
    EVEN_K: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    PDL_TILES: tl.constexpr = 0,
):
    """Stream-K: the (output tile, K-tile) iterations, tile-major, are cut into one contiguous,
    equal range per program, so a grid sized to the SMs keeps every SM busy to the end whatever
    the tile count (split-K rounds each tile to ``split`` equal parts). A program walks its range
    tile segment by tile segment: a segment that is a whole tile is written directly; the programs
    sharing a tile leave partials in the workspace (slot: program minus the tile's first owner) and
    the last to arrive reduces them, as split-K does."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    total = (num_pid_n * tl.cdiv(M, BLOCK_M) * num_k_tiles).to(tl.int64)  # iterations of the grid
    it = (pid * total) // num_programs
    end = ((pid + 1) * total) // num_programs
    if USE_PDL:
        if PDL_TILES > 0 and end > it:  # the first segment's weight tiles, as w4a16_mma_kernel does
            first_tile = it // num_k_tiles
            first_kt = it - first_tile * num_k_tiles
            first_rows = (first_tile % num_pid_n) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
            count = tl.minimum(tl.minimum(end - it, num_k_tiles - first_kt), PDL_TILES).to(tl.int32)
            _prefetch_k_tiles(qw_ptr, first_rows, stride_qr, first_kt, count, BITS, BLOCK_K)
        gdc_wait()
        gdc_launch_dependents()
    while it < end:
        tile = (it // num_k_tiles).to(tl.int32)
        kt_start = (it - tile * num_k_tiles).to(tl.int32)
        kt_end = tl.minimum(kt_start + (end - it), num_k_tiles).to(tl.int32)
        pid_m = tile // num_pid_n
        pid_n = tile - pid_m * num_pid_n
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        rows = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)  # [BLOCK_N / 4] storage rows
        mask_n = offs_n < N
        mask_m = offs_m < M
        acc = _accumulate(
            x_ptr,
            qw_ptr,
            scales_ptr,
            zeros_ptr,
            perm_ptr,
            offs_m,
            offs_n,
            rows,
            mask_m,
            mask_n,
            kt_start,
            kt_end,
            M,
            K,
            group_size,
            stride_xm,
            stride_qr,
            stride_sg,
            stride_zg,
            BITS,
            KW,
            HAS_ZEROS,
            HAS_PERM,
            NG,
            SCALE_W,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            FAST,
            DOT_F32,
            PREFETCH,
            EVEN_K,
        )
        # the programs owning the tile's first and last iteration (owner(i): start(p) <= i < start(p + 1))
        first = tile.to(tl.int64) * num_k_tiles
        owner_first = ((first + 1) * num_programs - 1) // total
        owner_last = ((first + num_k_tiles) * num_programs - 1) // total
        _write_tile(
            acc,
            out_ptr,
            bias_ptr,
            ws_ptr,
            cnt_ptr,
            offs_m,
            offs_n,
            mask_m,
            mask_n,
            stride_om,
            stride_wsk,
            stride_wsm,
            (pid - owner_first).to(tl.int32),
            (owner_last - owner_first + 1).to(tl.int32),
            tile,
            HAS_BIAS,
            True,
            SEGMENTED=True,
        )
        it += kt_end - kt_start


@triton.jit
def mma_dequant_kernel(
    qw_ptr,  # int32 [N_pad / 4, K_pad * 4 / vpw]
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # fp16 [num_groups, N]: z - 2**(bits-1) (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    out_ptr,  # [K, N] dense weight in input row order
    N,
    K,
    group_size,
    stride_qr,
    stride_sg,  # scales, zeros and out have unit N stride
    stride_zg,
    stride_ok,
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    kt = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
    offs_k = kt * BLOCK_K + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    wt = _weight_tile(qw_ptr, rows, kt, stride_qr, BITS, KW, BLOCK_N, BLOCK_K, dtype, FAST).to(tl.float32)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]  # [BN, BK]
    g = offs_k // group_size
    s = tl.load(scales_ptr + g[None, :] * stride_sg + offs_n[:, None], mask=mask, other=0.0)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + g[None, :] * stride_zg + offs_n[:, None], mask=mask, other=0.0)
        wt -= z.to(tl.float32)
    val = wt * s.to(tl.float32)  # [BN, BK]
    if HAS_PERM:
        dst = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
    else:
        dst = offs_k
    tl.store(out_ptr + dst[None, :] * stride_ok + offs_n[:, None], val.to(dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# Configurations and dispatch
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MmaConfig:
    """One launch. ``kind``: "mma" (w4a16_mma_kernel) or "dequant" (dense weight + cuBLAS)."""

    kind: str = "mma"
    block_m: int = 16
    block_n: int = 128
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    scale_w: bool = False  # scales on the weight values (async MMA chain) instead of the fp32 partial
    prefetch: bool = True  # group parameters loaded one K-tile ahead (else at use)
    max_regs: int = 0  # ptxas register cap per thread (0: none): 72 lets 7 decode programs share an SM
    chunk_n: int = 0  # "dequant": columns per L2-resident slab (0: the whole weight at once)
    stream_k: int = 0  # "mma": > 0 launches w4a16_mma_streamk_kernel with this many programs per SM

    def short(self) -> str:
        if self.kind == "dequant":
            return f"dequant+mm c{self.chunk_n}" if self.chunk_n else "dequant+mm"
        sw = " sw" if self.scale_w else ""
        pf = ("" if self.prefetch else " pf0") + (f" r{self.max_regs}" if self.max_regs else "")
        grid = f"sk{self.stream_k}" if self.stream_k else f"s{self.split_k}"
        return f"m{self.block_m} n{self.block_n} k{self.block_k} {grid} w{self.num_warps} st{self.num_stages}{sw}{pf}"


DEQUANT = MmaConfig(kind="dequant")
MAX_SPLIT_TILES_PER_N = 4  # split-K is only launched with <= 4 M-tiles
MIN_SPLIT_BLOCK_N = 64

# Tuned configs: (device index, K, N, bits, group_size, dtype, m_bucket) -> config; filled before
# CUDA-graph capture (bench / tuning), read-only on the hot path.
_TUNED: dict[tuple, MmaConfig] = {}


def num_split_counters(n: int) -> int:
    """Arrival counters a weight of N columns needs for every split-K config we launch."""
    return triton.cdiv(n, MIN_SPLIT_BLOCK_N) * MAX_SPLIT_TILES_PER_N


def m_bucket(m: int) -> int:
    return min(1 << max(0, (m - 1).bit_length()), 8192)


def _block_k_ok(block_k: int, group_size: int, k: int) -> bool:
    """A K-tile of ``block_k`` rows lies in one group, holds whole groups, or is cut by group boundaries
    only at multiples of 16 rows (groups of 48 or 80: the padded act-order groups of a row-parallel
    shard, qserve.distributed.sharding), at most 8 runs of one group (``_group_params``)."""
    return (
        group_size % block_k == 0 or group_size >= k or block_k % group_size == 0 or math.gcd(group_size, block_k) >= 16
    )


def groups_per_tile(block_k: int, group_size: int, k: int) -> int:
    """The kernels' ``NG`` for a K-tile of ``block_k`` rows that ``_block_k_ok`` accepts: 1 when the
    tile lies in one group, else its runs of one group (``_group_params``)."""
    return 1 if (group_size % block_k == 0 or group_size >= k) else block_k // math.gcd(group_size, block_k)


def _fix(cfg: MmaConfig, m: int, k: int, n: int, group_size: int) -> MmaConfig:
    """Clamp a config to what the kernel allows for this problem."""
    if cfg.kind != "mma":
        chunk = cfg.chunk_n // MMA_PAD_N * MMA_PAD_N if cfg.chunk_n > 0 else 0  # slabs start on row blocks
        return dataclasses.replace(cfg, chunk_n=0 if chunk == 0 or chunk >= n else chunk)
    block_k = cfg.block_k
    if not _block_k_ok(block_k, group_size, k):
        block_k = 64 if _block_k_ok(64, group_size, k) else 128
    num_warps = cfg.num_warps
    block_n = max(cfg.block_n, 16 * num_warps)  # each warp owns >= 16 rows of the A operand
    if (-(-n // MMA_PAD_N) * MMA_PAD_N) % block_n:  # N is padded to 64 rows only and the weight loads
        # are unmasked: a wider last tile would read past the stored weight
        block_n, num_warps = MMA_PAD_N, min(num_warps, MMA_PAD_N // 16)
    split = max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    shared_ok = block_n >= MIN_SPLIT_BLOCK_N and triton.cdiv(m, cfg.block_m) <= MAX_SPLIT_TILES_PER_N  # counters
    if split > 1 and not shared_ok:
        split = 1
    stream_k = max(0, cfg.stream_k) if shared_ok else 0
    if stream_k:
        split = 1  # the stream-K grid shares tiles by itself
    return dataclasses.replace(
        cfg, block_k=block_k, block_n=block_n, num_warps=num_warps, split_k=split, stream_k=stream_k
    )


SMALL_SHARED = 160 * 1024  # sm86 / sm89 allow a block 99 KB of shared memory (sm80 163 KB, sm90 227 KB)


def fit_shared(cfg: MmaConfig, max_shared: int | None, has_zeros: bool) -> MmaConfig:
    """Fewer pipeline stages where a launch would need more shared memory than the device lets one
    block have (the launch is refused outright). Read from the sm86 / sm89 compiles of every
    dispatched launch and sweep candidate (tests/kernels/test_launch_compile.py checks that every
    one fits after this): with asymmetric zeros the 128 x 128 tiles need 112 KB at 3 stages (the
    symmetric ones 80 KB), and the 6-stage sweep candidates 100 KB. Devices of 160 KB or more
    (sm80, sm90) keep every config as measured."""
    if cfg.kind != "mma" or max_shared is None or max_shared >= SMALL_SHARED:
        return cfg
    stages = min(cfg.num_stages, 4)
    if has_zeros and cfg.block_m * cfg.block_n >= 128 * 128:
        stages = min(stages, 2)
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


def _pow2_at_most(v: float) -> int:
    p = 1
    while p * 2 <= v and p < 8:
        p *= 2
    return p


def default_config(m: int, k: int, n: int, group_size: int) -> MmaConfig:
    """Built-in dispatch table by M, written as rules from ``bench/kernels.py --sweep`` on an H200
    (Qwen2.5-14B shapes; bench/RESULTS.md), so other shapes get the same kind of launch. Split-K
    brings the program count to a per-M target (more programs, more weight bytes in flight)."""
    if m == 1:  # one sequence: the third session's sweep picked this tile for all four Qwen2.5-14B
        # layers at M=1 (1-7% ahead of the rule below), split-K to ~220-320 programs
        cfg = MmaConfig(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3)
        split = _pow2_at_most(330 / triton.cdiv(n, 128))
    elif m <= 16:  # decode: 64-row tiles, 4 stages of 4 KB each, ~800 programs; 72 registers (the
        # prefetch alone needs 79 on sm90: 6 programs per SM instead of 7)
        cfg = MmaConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, max_regs=72)
        tiles = triton.cdiv(n, 64)
        split = min(8, triton.next_power_of_2(max(1, triton.cdiv(800, tiles))))
    elif m <= 32:
        cfg, tiles = MmaConfig(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=4), triton.cdiv(n, 64)
        split = _pow2_at_most(450 / tiles)
    elif m <= 64:
        cfg, tiles = MmaConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3), triton.cdiv(n, 128)
        split = _pow2_at_most(250 / tiles)
    elif m <= 128 and n >= 16384:  # wide layers (gate_up): enough tiles without split-K (the third
        # session's sweep: 89 us at M 128). Scales on the weights with 64-deep K-tiles and 3+ stages
        # won the second session's sweep but race on the H200 (wrong or non-finite output from run to
        # run: bench/RESULTS.md); they are out of the dispatch and the sweep.
        cfg = MmaConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
        split = 1
    elif m <= 256 and k >= 2 * n:  # K-heavy (down): 40 column tiles of 128 leave SMs idle; split-K
        # by 3 on 64-column tiles (the sweeps at M 128: 51-52 us vs 73 us)
        cfg = MmaConfig(block_m=128, block_n=64, block_k=128, num_warps=4, num_stages=3)
        split = 3
    elif m <= 128:
        cfg, tiles = MmaConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3), triton.cdiv(n, 128)
        split = _pow2_at_most(150 / tiles)
    else:  # dense weight + cuBLAS: the fused kernel lost at every other M > 128 (bench/RESULTS.md)
        return DEQUANT
    return _fix(dataclasses.replace(cfg, split_k=split), m, k, n, group_size)


AMPERE_TABLE_ENV = "QSERVE_W4A16_AMPERE_TABLE"


def ampere_config(m: int, k: int, n: int, group_size: int) -> MmaConfig:
    """The sm80-89 (mma.sync) table, opt-in with ``QSERVE_W4A16_AMPERE_TABLE=1``: rules from the
    Ampere proxy sweep (``bench/kernels.py --ampere-proxy --sweep``: the sm86 PTX timed on the H200,
    2026-12-05, bench/RESULTS.md), so its ranking of tile configs, not its speeds. Up to 32 rows the
    H200 rules were best or within 3-4%; at 33-64 rows the stream-K grid of 64 x 128 tiles (2
    programs per SM) won for o, gate_up and down (down 1.33x; qkv 7% slower); at 65-128, stream-K
    with 128 x 128 tiles and 8 warps (1 per SM) for qkv, gate_up and down (o 4% behind split-K 3);
    past 128 rows, dequantize + cuBLAS for all four (down 1.69x the H200 rule's MMA launch). Opt-in:
    measured on a proxy, and no whole ``pytest -m gpu`` can run it on the H200."""
    if m <= 32:
        return default_config(m, k, n, group_size)
    if m <= 64:
        cfg = MmaConfig(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3, stream_k=2)
    elif m <= 128:
        cfg = MmaConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3, stream_k=1)
    else:
        return DEQUANT
    return _fix(cfg, m, k, n, group_size)


def _uses_ampere_table(device: torch.device) -> bool:
    """``QSERVE_W4A16_AMPERE_TABLE=1`` on an sm80-89 device (a dict lookup and a cached query)."""
    return os.environ.get(AMPERE_TABLE_ENV) == "1" and device.type == "cuda" and kdevice.capability(device)[0] == 8


GLUON_ENV = "QSERVE_W4A16_GLUON"
GLUON_MIN_M = 65  # the Gluon kernel from here up (where w4a16_mma_kernel waits on every MMA)
GLUON_MAX_M = 512  # unset: up to here (past it dense weight + cuBLAS won the engine's 1,024-row mixed step)


def gluon_setting() -> str:
    """``QSERVE_W4A16_GLUON``: "" (unset or empty: the measured rows, ``gluon_by_default``), "1" (every row
    count from ``GLUON_MIN_M``), "0" (never). Anything else is refused, naming the variable. Under 65 rows
    the Triton kernel stays: a Gluon launch for 1-64 rows (16-64-row x tiles, 6 stages, K shares to three
    programs an SM) decoded 27% slower at batch 1 (bench/RESULTS.md, twenty-first session)."""
    value = os.environ.get(GLUON_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{GLUON_ENV}={value!r}: expected 1 (from {GLUON_MIN_M} rows), 0 (off) or unset")
    return value


def gluon_by_default(k: int, n: int, m: int) -> bool:
    """Where the Gluon kernel's default launch beat the other paths on the H100 (bench/RESULTS.md, twentieth and
    twenty-first sessions; Qwen2.5-14B layers): 65-512 rows of every layer (gate_up at 128 rows 88 -> 66 µs,
    at 256 166 -> 131; the K-heavy down at 128 rows in 3 K shares 50 µs by the Triton split-K launch -> 40).
    Past 512 rows dense weight + cuBLAS stays: the mixed step of 1,024 rows took 56.19 ms of GPU time with the
    Gluon kernel for gate_up / qkv / o against 54.05 without, though the layer benchmark had it ahead at
    1,024 rows (gate_up 515-560 vs 586 µs). ``k`` and ``n`` are the weight's (the rule is by rows alone)."""
    return GLUON_MIN_M <= m <= GLUON_MAX_M


GLUON_NARROW_ENV = "QSERVE_W4A16_GLUON_NARROW"
GLUON_NARROW_MIN_M = 33  # the narrow launch's rows: GLUON_NARROW_MIN_M .. GLUON_MIN_M - 1 (decode buckets 48, 64)


def gluon_narrow(k: int, n: int, m: int, sms: int) -> bool:
    """The narrow launch (``QSERVE_W4A16_GLUON_NARROW=0`` opts out): at 33-64 rows the Gluon kernel's 64-row
    x tiles in K shares serve the layers whose output tiles leave the SMs' program slots idle, i.e. where
    ``auto_split`` splits (qkv, o and down of Qwen2.5-14B; gate_up fills the card and stays with the Triton
    table: 44 against 57 µs). On the H100 at 48 / 64 rows it took qkv from 20.5 / 21.6 µs to 17.7, o from
    20.4 / 21.0 to 15.0 / 14.8, down from 37.9 / 38.9 to 28.0 / 27.8, and decode at batch 48 and 64 rose 14.5%
    (bench/RESULTS.md, twenty-second session); the Triton table won every layer at 32 rows (twenty-first)."""
    from quant_kernels import w4a16_wgmma_gluon

    if not GLUON_NARROW_MIN_M <= m < GLUON_MIN_M or not env_switch(GLUON_NARROW_ENV, default=True):
        return False
    return w4a16_wgmma_gluon.default_config(m, k, n, sms).split_k > 1


def uses_gluon(weight: MmaQuantWeight, x: torch.Tensor, m: int) -> bool:
    """Whether ``w4a16_wgmma_gluon`` serves this product: an sm90 device, a weight it serves
    (``w4a16_wgmma_gluon.supports``), and the rows ``gluon_setting`` says (unset: ``gluon_by_default``; under
    65 rows only ``gluon_narrow``'s)."""
    if m < GLUON_NARROW_MIN_M or not kdevice.triton_serves(x.device):
        return False
    setting = gluon_setting()
    if setting == "0" or kdevice.capability(x.device)[0] != 9:
        return False
    k, n = weight.in_features, weight.out_features
    if m < GLUON_MIN_M:
        if not gluon_narrow(k, n, m, _num_sms(x.device)):
            return False
    elif setting == "" and not gluon_by_default(k, n, m):
        return False
    from quant_kernels import w4a16_wgmma_gluon

    return w4a16_wgmma_gluon.supports(weight, x.dtype)


def _key(weight: MmaQuantWeight, dtype: torch.dtype, m: int) -> tuple:
    device = weight.qweight.device
    index = device.index if device.type == "cuda" else -1
    return (index, weight.in_features, weight.out_features, weight.bits, weight.group_size, dtype, m_bucket(m))


def set_config(weight: MmaQuantWeight, dtype: torch.dtype, m: int, cfg: MmaConfig) -> None:
    """Pin the config for this weight's shape and M bucket (tuning and benchmarks)."""
    _TUNED[_key(weight, dtype, m)] = cfg


def select_config(weight: MmaQuantWeight, dtype: torch.dtype, m: int) -> MmaConfig:
    """Pure dict lookup + arithmetic: safe on the hot path and under CUDA-graph capture."""
    k, n, g = weight.in_features, weight.out_features, weight.group_size
    cfg = _TUNED.get(_key(weight, dtype, m))
    if cfg is None:
        table = ampere_config if _uses_ampere_table(weight.qweight.device) else default_config
        cfg = table(m, k, n, g)
        if cfg.max_regs and (weight.zeros is not None or weight.perm is not None):
            cfg = dataclasses.replace(cfg, max_regs=0)  # zeros + act-order spill under the cap (sm90 ptxas)
    return _fix(cfg, m, k, n, g)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _num_sms(device: torch.device) -> int:
    """SMs of ``device`` (the stream-K grid's unit); 1 off CUDA, so CPU tests set the grid directly."""
    return kdevice.sm_count(device, default=1)


def supports(weight: PackedQuantWeight) -> bool:
    """Whether the kernel serves this weight: on a CUDA device, one with 16-bit tensor-core MMA
    (sm80+; older cards take the reference path), and a K-tile of 64 or 128 rows that ``_block_k_ok``
    accepts: in one group, whole groups, or runs of one group in steps of 16 rows (else the caller
    keeps the reference path)."""
    device = weight.qweight.device
    if kdevice.triton_serves(device) and kdevice.capability(device) < (8, 0):
        return False
    g, k = weight.group_size, weight.in_features
    return any(_block_k_ok(bk, g, k) for bk in (64, 128))


def prepare(weight: PackedQuantWeight, kwidth: int | None = None) -> MmaQuantWeight:
    """Load-time: canonical -> MMA-operand order for this device's MMA generation."""
    if not supports(weight):
        raise ValueError(f"group_size={weight.group_size} is not served by the MMA kernel")
    if kwidth is None:
        device = weight.qweight.device
        kwidth = mma_kwidth(kdevice.capability(device)) if kdevice.triton_serves(device) else 2
    shuffled = mma_shuffle(weight, kwidth)
    shuffled.scales = shuffled.scales.contiguous()  # the kernels assume unit N strides
    if shuffled.zeros is not None:
        shuffled.zeros = shuffled.zeros.contiguous()
    return shuffled


def _fast_ok(bits: int, dtype: torch.dtype) -> bool:
    return not _INTERPRET and (bits == 4 or dtype == torch.float16)


def dequantize_dense(
    weight: MmaQuantWeight,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,  # [K, n1 - n0], unit N stride
    n0: int = 0,
    n1: int | None = None,
) -> torch.Tensor:
    """Dense ``[K, n1 - n0]`` weight columns ``n0:n1`` (all by default) in *input* row order (perm
    undone), in ``dtype``. ``n0`` must be a multiple of 64 (whole stored row blocks)."""
    k = weight.in_features
    n1 = weight.out_features if n1 is None else n1
    if n0 % MMA_PAD_N or not 0 <= n0 < n1 <= weight.out_features:
        raise ValueError(f"column range {n0}:{n1} is not a 64-aligned range of {weight.out_features}")
    nc = n1 - n0
    if out is None:
        out = torch.empty((k, nc), dtype=dtype, device=weight.qweight.device)  # [K, nc]
    block_n, block_k = 64, 64
    qw, sc = weight.qweight[n0 // 4 :], weight.scales[:, n0:]  # views: the kernel takes strides
    device = weight.qweight.device
    zeros = weight.zeros[:, n0:] if weight.zeros is not None else kdevice.placeholder(device, torch.float16)
    perm = weight.perm if weight.perm is not None else kdevice.placeholder(device, torch.int64)
    grid = (triton.cdiv(nc, block_n), weight.k_pad // block_k)
    mma_dequant_kernel[grid](
        qw,
        sc,
        zeros,
        perm,
        out,
        nc,
        k,
        weight.group_size,
        qw.stride(0),
        sc.stride(0),
        zeros.stride(0) if weight.zeros is not None else 0,
        out.stride(0),
        BITS=weight.bits,
        KW=weight.kwidth,
        HAS_ZEROS=weight.zeros is not None,
        HAS_PERM=weight.perm is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FAST=_fast_ok(weight.bits, dtype),
        num_warps=4,
    )
    return out


def _dequant_mm(
    x: torch.Tensor,  # [M, K]
    weight: MmaQuantWeight,
    bias: torch.Tensor | None,  # [N]
    out: torch.Tensor,  # [M, N], unit N stride
    chunk_n: int,
) -> torch.Tensor:
    """Dense weight + cuBLAS. With ``chunk_n``, column slab by column slab through one reused
    ``[K, chunk_n]`` buffer small enough to stay in L2: cuBLAS reads each slab from L2 and the next
    slab overwrites the same lines, so the fp16 weight never makes a round trip through DRAM (the
    whole-weight version writes and re-reads 2 bytes per weight). cuBLAS writes each output slab
    in place (a column slice of ``out`` is a valid strided matrix for it)."""
    n = weight.out_features
    if chunk_n <= 0 or chunk_n >= n:
        dense = dequantize_dense(weight, x.dtype)  # [K, N] input order: no gather of x
        if bias is None:
            return torch.mm(x, dense, out=out)
        return torch.addmm(bias.to(x.dtype), x, dense, out=out)
    scratch = torch.empty((weight.in_features, chunk_n), dtype=x.dtype, device=x.device)  # [K, chunk_n]
    for n0 in range(0, n, chunk_n):
        n1 = min(n0 + chunk_n, n)
        dense = dequantize_dense(weight, x.dtype, out=scratch[:, : n1 - n0], n0=n0, n1=n1)  # [K, nc]
        if bias is None:
            torch.mm(x, dense, out=out[:, n0:n1])
        else:
            torch.addmm(bias[n0:n1].to(x.dtype), x, dense, out=out[:, n0:n1])
    return out


def w4a16_gemm(
    x: torch.Tensor,  # [M, K] fp16 / bf16
    weight: MmaQuantWeight,
    bias: torch.Tensor | None = None,  # [N]
    config: MmaConfig | None = None,
    counters: torch.Tensor | None = None,  # int32 [>= num_split_counters(N)], zeros; reused across calls
    out: torch.Tensor | None = None,  # [M, N]
    pdl: bool | None = None,  # launch with PDL (None: QSERVE_ENABLE_PDL; quant_kernels.pdl)
) -> torch.Tensor:
    """``x[:, perm] @ dequant(weight) + bias`` on CUDA (or under TRITON_INTERPRET=1); ``[M, N]``."""
    m, k = x.shape
    n, g = weight.out_features, weight.group_size
    if k != weight.in_features:
        raise ValueError(f"x has K={k}, weight has in_features={weight.in_features}")
    if out is not None and out.stride(1) != 1:
        raise ValueError("out must have a unit stride along N")
    # The built-in dispatch only: a config passed in or pinned (``set_config``: the sweeps) is this kernel's
    if config is None and uses_gluon(weight, x, m) and _key(weight, x.dtype, m) not in _TUNED:
        from quant_kernels import w4a16_wgmma_gluon

        return w4a16_wgmma_gluon.w4a16_wgmma(
            x,
            weight,
            bias,
            config=w4a16_wgmma_gluon.default_config(m, k, n, _num_sms(x.device)),
            out=out,
            counters=counters,
        )
    cfg = select_config(weight, x.dtype, m) if config is None else _fix(config, m, k, n, g)
    cfg = fit_shared(cfg, kdevice.max_shared(x.device), weight.zeros is not None)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if cfg.kind == "dequant":
        return _dequant_mm(x, weight, bias, out, cfg.chunk_n)

    split = cfg.split_k
    num_pid_m = triton.cdiv(m, cfg.block_m)
    num_pid_n = triton.cdiv(n, cfg.block_n)
    num_k_tiles = triton.cdiv(k, cfg.block_k)
    total = num_pid_m * num_pid_n * num_k_tiles
    programs = min(total, _num_sms(x.device) * cfg.stream_k) if cfg.stream_k else 0
    if programs == 1:  # one program does it all: the plain grid (no partials to reduce)
        programs = 0
    # stream-K: a tile's K-tiles meet at most floor(K-tiles / per-program share) + 2 programs
    slots = min(programs, num_k_tiles // (total // programs) + 2) if programs else split
    # Every pointer argument has one dtype whatever the launch: the unused ones get typed placeholders
    # (quant_kernels.device.placeholder), never another tensor of the launch.
    if counters is not None and counters.dtype != torch.int32:
        raise ValueError(f"counters must be int32, got {counters.dtype}")
    if slots > 1:
        ws = torch.empty((slots, m, n), dtype=torch.float32, device=x.device)  # [slots, M, N]
        if counters is None:
            counters = torch.zeros(num_pid_m * num_pid_n, dtype=torch.int32, device=x.device)
        elif counters.numel() < num_pid_m * num_pid_n:
            raise ValueError(f"counters hold {counters.numel()} entries, need {num_pid_m * num_pid_n}")
    else:
        ws = kdevice.placeholder(x.device, torch.float32)
        if counters is None:
            counters = kdevice.placeholder(x.device, torch.int32)
    qw, sc = weight.qweight, weight.scales
    zeros = weight.zeros if weight.zeros is not None else kdevice.placeholder(x.device, torch.float16)
    perm = weight.perm if weight.perm is not None else kdevice.placeholder(x.device, torch.int64)
    bias_arg = bias if bias is not None else kdevice.placeholder(x.device, x.dtype)
    ng = groups_per_tile(cfg.block_k, g, k)
    launch_opts = {"maxnreg": cfg.max_regs} if cfg.max_regs and not _INTERPRET else {}
    with_pdl = use_pdl(x.device, pdl)
    if with_pdl:
        launch_opts["launch_pdl"] = True
    pointers = (x, qw, sc, zeros, perm, bias_arg, out, ws, counters)
    strides = (
        x.stride(0),
        qw.stride(0),
        sc.stride(0),
        zeros.stride(0) if weight.zeros is not None else 0,
        out.stride(0),
        ws.stride(0) if slots > 1 else 0,
        ws.stride(1) if slots > 1 else 0,
    )
    meta = dict(
        BITS=weight.bits,
        KW=weight.kwidth,
        HAS_ZEROS=weight.zeros is not None,
        HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None,
        NG=ng,
        SCALE_W=cfg.scale_w or ng > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FAST=_fast_ok(weight.bits, x.dtype),
        DOT_F32=_INTERPRET,
        PREFETCH=cfg.prefetch,
        EVEN_K=k % cfg.block_k == 0,
        USE_PDL=with_pdl,
        PDL_TILES=cfg.num_stages if with_pdl else 0,  # what the pipeline's prologue asks for first
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **launch_opts,
    )
    if programs:
        w4a16_mma_streamk_kernel[(programs,)](*pointers, m, n, k, g, *strides, **meta)
    else:
        grid = (num_pid_n, split, num_pid_m)
        w4a16_mma_kernel[grid](*pointers, m, n, k, g, split, *strides, USE_SPLIT=split > 1, **meta)
    return out


def candidate_configs(m: int, k: int, n: int, group_size: int) -> list[MmaConfig]:
    """Configs worth timing for this M (``bench/kernels.py --sweep`` times these)."""
    out: list[MmaConfig] = []
    block_m = max(16, triton.next_power_of_2(min(m, 256)))
    if m <= 64:
        # (block_n, block_k, warps, stages, scale_w, prefetch of the group parameters)
        for bn, bk, warps, stages, sw, pf in (
            (64, 128, 4, 4, False, True),
            (64, 128, 4, 4, False, False),
            (64, 128, 4, 6, False, True),
            (128, 128, 4, 3, False, True),
            (128, 128, 8, 3, False, True),
        ):
            for split in (1, 2, 4, 8):
                out.append(MmaConfig("mma", block_m, bn, bk, split, warps, stages, sw, pf))
        if m <= 16:  # the decode tile under a 72-register cap (80 uncapped: 6 programs per SM, not 7)
            for split in (1, 2, 4, 8):
                out.append(MmaConfig("mma", block_m, 64, 128, split, 4, 4, False, True, 72))
        # stream-K grids of a few programs per SM (the fixed per-launch latency of the small layers)
        for bn, warps, stages, regs, per_sm in (
            ((64, 4, 4, 72, 6), (64, 4, 4, 72, 7), (64, 4, 4, 0, 6), (128, 4, 3, 0, 2), (128, 4, 3, 0, 3))
            if m <= 16
            else ((128, 4, 3, 0, 1), (128, 4, 3, 0, 2), (64, 4, 4, 0, 3))
        ):
            out.append(MmaConfig("mma", block_m, bn, 128, 1, warps, stages, max_regs=regs, stream_k=per_sm))

    elif m <= 256:  # 128-row M tiles: 256 rows spill (ptxas stack 496-624 B on sm90)
        for bm, bn, bk, warps, stages, sw in (
            (128, 128, 128, 8, 3, False),
            (128, 64, 128, 4, 3, False),
            (128, 64, 128, 4, 3, True),
            (128, 256, 64, 8, 3, True),  # the second session's winners, which raced before 95c45a7
            (128, 128, 64, 4, 4, True),
        ):
            for split in (1, 2, 3, 4, 8):  # 3: one wave of 1-2 programs per SM for 40-56 N-tiles
                out.append(MmaConfig("mma", bm, bn, bk, split, warps, stages, sw))
        for bn, warps, per_sm in ((64, 4, 2), (128, 8, 1)):
            out.append(MmaConfig("mma", 128, bn, 128, 1, warps, 3, stream_k=per_sm))
        out.append(DEQUANT)
    else:
        for bm, bn, bk, warps, stages, sw in ((128, 128, 128, 8, 3, False), (128, 64, 128, 4, 3, True)):
            out.append(MmaConfig("mma", bm, bn, bk, 1, warps, stages, sw))
        out.append(DEQUANT)
    if m > 64:  # dense slabs that stay in L2: ~16 MB and ~32 MB of fp16 weight
        for slab_bytes in (16 << 20, 32 << 20):
            out.append(dataclasses.replace(DEQUANT, chunk_n=max(256, slab_bytes // (2 * k) // 256 * 256)))
    uniq: list[MmaConfig] = []
    for cfg in out:
        cfg = _fix(cfg, m, k, n, group_size)
        if cfg not in uniq:
            uniq.append(cfg)
    return uniq


def compile_ptx(
    arch: int,
    cfg: MmaConfig,
    bits: int = 4,
    dtype: str = "fp16",
    group_tile: int = 1,
    asym: bool = False,
    act_order: bool = False,
    kwidth: int = 2,
    group_size: int | None = None,
) -> str:
    """PTX of ``w4a16_mma_kernel`` for ``sm_<arch>`` without a GPU (``triton.compile`` with a
    ``GPUTarget``): the regression check that the dequantized tile stays out of shared memory."""
    return compile_for(arch, cfg, bits, dtype, group_tile, asym, act_order, kwidth, group_size).asm["ptx"]


def compile_for(
    arch: int,
    cfg: MmaConfig,
    bits: int = 4,
    dtype: str = "fp16",
    group_tile: int = 1,
    asym: bool = False,
    act_order: bool = False,
    kwidth: int = 2,
    group_size: int | None = None,
    pdl: bool = False,
    even_k: bool = True,
):
    """The compiled kernel for ``sm_<arch>`` (no GPU needed): ``.asm["ptx"]`` and ``.metadata.shared``
    (bytes of shared memory: the pipeline's buffers show whether the weight tiles are multi-buffered)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = w4a16_mma_streamk_kernel if cfg.stream_k else w4a16_mma_kernel
    pointers = {
        "x_ptr": f"*{dtype}",
        "qw_ptr": "*i32",
        "scales_ptr": "*fp16",
        "zeros_ptr": "*fp16",
        "perm_ptr": "*i64",
        "bias_ptr": f"*{dtype}",
        "out_ptr": f"*{dtype}",
        "ws_ptr": "*fp32",
        "cnt_ptr": "*i32",
    }
    if group_size is None:  # whole groups per tile, or a tile inside one group of 128 (or more)
        group_size = cfg.block_k // group_tile if group_tile > 1 else max(128, cfg.block_k)
    constants = dict(
        group_size=group_size,
        BITS=bits,
        KW=kwidth,
        HAS_ZEROS=asym,
        HAS_PERM=act_order,
        HAS_BIAS=False,
        NG=group_tile,
        SCALE_W=cfg.scale_w or group_tile > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_SPLIT=cfg.split_k > 1,
        FAST=bits == 4 or dtype == "fp16",
        DOT_F32=False,
        PREFETCH=cfg.prefetch,
        EVEN_K=even_k,
        USE_PDL=pdl,
        PDL_TILES=cfg.num_stages if pdl else 0,
    )
    constants = {name: value for name, value in constants.items() if name in fn.arg_names}
    signature = {}
    for name in fn.arg_names:
        if name in pointers:
            signature[name] = pointers[name]
        elif name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    # What the JIT specializes at run time for real shapes: 16-byte-aligned pointers and
    # multiple-of-16 sizes and strides (M is never specialized).
    aligned = [
        (i,) for i, name in enumerate(fn.arg_names) if signature[name] != "constexpr" and name not in ("M", "split_k")
    ]
    attrs = {path: [["tt.divisibility", 16]] for path in aligned}
    return triton.compile(
        ASTSource(fn, signature, constants, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
            **({"launch_pdl": True} if pdl else {}),
        ),
    )
