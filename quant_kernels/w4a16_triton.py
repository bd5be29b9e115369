"""Triton W4A16 / W8A16 kernels: fused dequant-GEMM (decode and tiled) and a dequantize kernel.

Knows: the tile-interleaved kernel layout (``quant_kernels.repack.TiledQuantWeight``: int32 words
``[K_pad/pf, N]``, N contiguous, code ``j`` of the ``ib`` word rows of K-tile ``t`` covers the
contiguous packed rows ``t*BK + j*ib + [0, ib)``), how to tile it, and which launch configuration
serves which ``(M, K, N)``. Must not know: models, checkpoint formats, engines. Imported lazily
by ``quant_kernels.ops`` on CUDA only (and by the CPU tests under TRITON_INTERPRET=1).

Kernels
-------
``w4a16_gemm_kernel``: ``out[M, N] = x[:, perm] @ dequant(W) + bias`` with fp32 accumulation.
  A program owns a ``BLOCK_M x BLOCK_N`` output tile and a K-slice (split-K). Per K-tile it loads
  the ``[ib, BLOCK_N]`` words once (16-byte loads along N; cp.async-pipelined on the dot path),
  and for each code position ``j`` multiplies the codes with the contiguous x slice
  ``x[:, t*BK + j*ib : ...]`` (gathered through ``perm`` for act-order). Three modes:
  * ``USE_DOT`` (tensor cores, M padded to 16): codes become fp16/bf16 ``q - zero`` through packed
    half2 PTX (``FAST``: ``(w >> 4i) & 0x000F000F | 0x64006400`` is the half2 ``1024 + q`` of codes i
    and i+4; one ``sub.f16x2`` gives both, ~1.4 instructions/code); ``PF`` thin k=ib dots, or with
    ``CAT`` the slices stacked into one ``[BLOCK_K, BLOCK_N]`` tile and one dot; ``SWAP_AB``
    computes ``(W^T x^T)^T`` so the weight is the wgmma A operand from registers and small M is
    the MMA's N.
  * FMA (``USE_DOT=False``, M == 1): CUDA-core GEMV, codes to fp32 with the 2**23 exponent trick
    (``(q | 0x4B000000)`` as fp32 is ``2**23 + q``), no int->float converts.
  Scales: once per K-tile after the dots when ``group_size % BLOCK_K == 0`` (``SCALE_PER_TILE``),
  else per code position (``ib`` divides the group size: P16). Split-K partials go to an fp32
  workspace; the last program of a tile (atomic counter) sums them, adds bias, writes the
  output and resets its counter: one launch, no memset, no host work.
``w4a16_dequant_kernel``: dense ``[K, N]`` weight in the activation dtype, rows scattered back
  to input order through ``perm``; the large-M path then calls cuBLAS (``x @ W``).

Dispatch (``w4a16_gemm``) picks a ``W4A16Config`` from M (a Python int from ``x.shape``): a
tuned entry in ``_TUNED`` (filled by ``tune_w4a16``/``set_config`` before any CUDA-graph
capture, keyed by device, shape, bits, group, dtype and M bucket) or ``default_config``'s rules
measured on an H200. No host sync and no allocation-dependent decisions: calls are safe to
capture in a CUDA graph once compiled (``quant_kernels.ops.warmup_w4a16``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quant_kernels import device as kdevice
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.repack import DEFAULT_INTERLEAVE, TiledQuantWeight, tile_interleave

# Under TRITON_INTERPRET=1 (CPU tests) bf16 tl.dot gives garbage in Triton 3.6's interpreter and
# inline PTX cannot run, so the launcher passes DOT_F32 / FAST=False there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

MAGIC_F32 = 0x4B000000  # fp32 bits of 2**23: (q | MAGIC_F32) as fp32 is 2**23 + q
_F16_MAGIC = {torch.float16: 0x6400, torch.bfloat16: 0x4300}  # 1024 (fp16) / 128 (bf16): ulp 1

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _code_f32(w, j: tl.constexpr, zm, BITS: tl.constexpr):
    """Code j of every word as fp32 ``q - zero`` (``zm`` = fp32 ``2**23 + zero``): 3 ALU ops."""
    q = (w.to(tl.uint32, bitcast=True) >> (BITS * j)) & ((1 << BITS) - 1)  # logical shift: no sign extend
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - zm


@triton.jit
def _codes_fast(w, zz, BITS: tl.constexpr, IS_BF16: tl.constexpr):
    """All codes of every word as fp16/bf16 ``q - zero`` through packed half2 PTX.

    ``zz``: int32 holding the half2 ``(M + zero, M + zero)`` (fp16: M = 1024; bf16: M = 128, and
    negated for the bf16 fma). ``(w >> 4i) & 0x000F000F | M`` is the half2 of codes i and i+4;
    one packed subtract gives both, exactly. ~1.4 instructions per 4-bit code.
    """
    if BITS == 4:
        if IS_BF16:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, t2, t3, s0, s1, s2, one; mov.b32 one, 0x3f803f80; "
                "lop3.b32 t0, $8, 0x000f000f, 0x43004300, 0xea; "
                "shr.u32 s0, $8, 4; lop3.b32 t1, s0, 0x000f000f, 0x43004300, 0xea; "
                "shr.u32 s1, $8, 8; lop3.b32 t2, s1, 0x000f000f, 0x43004300, 0xea; "
                "shr.u32 s2, $8, 12; lop3.b32 t3, s2, 0x000f000f, 0x43004300, 0xea; "
                "fma.rn.bf16x2 t0, t0, one, $9; fma.rn.bf16x2 t1, t1, one, $9; "
                "fma.rn.bf16x2 t2, t2, one, $9; fma.rn.bf16x2 t3, t3, one, $9; "
                "mov.b32 {$0, $4}, t0; mov.b32 {$1, $5}, t1; mov.b32 {$2, $6}, t2; mov.b32 {$3, $7}, t3; }",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
                [w, zz],
                dtype=(tl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t0, t1, t2, t3, s0, s1, s2; "
                "lop3.b32 t0, $8, 0x000f000f, 0x64006400, 0xea; "
                "shr.u32 s0, $8, 4; lop3.b32 t1, s0, 0x000f000f, 0x64006400, 0xea; "
                "shr.u32 s1, $8, 8; lop3.b32 t2, s1, 0x000f000f, 0x64006400, 0xea; "
                "shr.u32 s2, $8, 12; lop3.b32 t3, s2, 0x000f000f, 0x64006400, 0xea; "
                "sub.f16x2 t0, t0, $9; sub.f16x2 t1, t1, $9; sub.f16x2 t2, t2, $9; sub.f16x2 t3, t3, $9; "
                "mov.b32 {$0, $4}, t0; mov.b32 {$1, $5}, t1; mov.b32 {$2, $6}, t2; mov.b32 {$3, $7}, t3; }",
                "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
                [w, zz],
                dtype=(tl.float16,) * 8,
                is_pure=True,
                pack=1,
            )
    else:  # 8-bit, fp16 only: bytes i and i+2 share a half2
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t0, t1, s0; "
            "lop3.b32 t0, $4, 0x00ff00ff, 0x64006400, 0xea; "
            "shr.u32 s0, $4, 8; lop3.b32 t1, s0, 0x00ff00ff, 0x64006400, 0xea; "
            "sub.f16x2 t0, t0, $5; sub.f16x2 t1, t1, $5; "
            "mov.b32 {$0, $2}, t0; mov.b32 {$1, $3}, t1; }",
            "=h,=h,=h,=h,r,r",
            [w, zz],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )


@triton.jit
def _codes_slow(w, zm, BITS: tl.constexpr, dtype: tl.constexpr):
    """``_codes_fast`` without PTX (interpreter, bf16 8-bit): every code via ``_code_f32``."""
    if BITS == 4:
        return (
            _code_f32(w, 0, zm, BITS).to(dtype),
            _code_f32(w, 1, zm, BITS).to(dtype),
            _code_f32(w, 2, zm, BITS).to(dtype),
            _code_f32(w, 3, zm, BITS).to(dtype),
            _code_f32(w, 4, zm, BITS).to(dtype),
            _code_f32(w, 5, zm, BITS).to(dtype),
            _code_f32(w, 6, zm, BITS).to(dtype),
            _code_f32(w, 7, zm, BITS).to(dtype),
        )
    else:
        return (
            _code_f32(w, 0, zm, BITS).to(dtype),
            _code_f32(w, 1, zm, BITS).to(dtype),
            _code_f32(w, 2, zm, BITS).to(dtype),
            _code_f32(w, 3, zm, BITS).to(dtype),
        )


@triton.jit
def _cat_rows(a, b):
    """Stack two [R, C] tensors into [2R, C] (a's rows first), keeping row order."""
    ab = tl.permute(tl.join(a, b), (2, 0, 1))  # [2, R, C]
    return tl.reshape(ab, (2 * a.shape[0], a.shape[1]))


@triton.jit
def _finish_tile(
    acc,  # fp32 [BLOCK_M, BLOCK_N]
    offs_m,
    offs_n,
    M,
    N,
    bias_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    split_k,
    pid_k,
    tile_id,
    stride_om,
    stride_on,
    stride_wsk,
    stride_wsm,
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Write a tile; with split-K the last-arriving program sums the partials (one launch)."""
    dtype = out_ptr.dtype.element_ty
    mask_n = offs_n < N
    mask_mn = (offs_m < M)[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(dtype), mask=mask_mn)
    else:
        ws_tile = ws_ptr + offs_m[:, None] * stride_wsm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(ws_tile + pid_k * stride_wsk, acc, mask=mask_mn)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # last program of this tile: reduce, add bias, write, reset
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sk in range(0, split_k):
                total += tl.load(ws_tile + sk * stride_wsk, mask=mask_mn, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(dtype), mask=mask_mn)
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def w4a16_gemm_kernel(
    x_ptr,  # [M, K] fp16 / bf16
    qw_ptr,  # int32 [K_pad // PF, N], tile-interleaved (quant_kernels.repack)
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # uint8 [num_groups, N] (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    bias_ptr,  # [N] (unused when not HAS_BIAS)
    out_ptr,  # [M, N] x dtype
    ws_ptr,  # fp32 [split_k, M, N] split-K partials (unused when not USE_SPLIT)
    cnt_ptr,  # int32 [>= num tiles] zero-initialised arrival counters (unused when not USE_SPLIT)
    M,
    N,
    K,
    group_size,
    split_k,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_om,
    stride_on,
    stride_wsk,
    stride_wsm,
    BITS: tl.constexpr,
    IB: tl.constexpr,  # word rows per K-tile (the layout's interleave); BLOCK_K = PF * IB
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,  # group_size % BLOCK_K == 0: one scale row per K-tile
    USE_DOT: tl.constexpr,  # tensor cores; else CUDA-core FMAs (BLOCK_M == 1)
    SWAP_AB: tl.constexpr,  # compute (W^T x^T)^T: the weight tile is the MMA's A operand
    CAT: tl.constexpr,  # stack the PF code slices into one [BLOCK_K, BLOCK_N] tile: one dot per K-tile
    FAST: tl.constexpr,  # packed-half2 PTX dequant (dot path, 4-bit fp16/bf16 or 8-bit fp16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0: no N masks on the weight
    DOT_F32: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = PF * IB
    SYM_ZM: tl.constexpr = 8388608.0 + (1 << (BITS - 1))  # 2**23 + implicit zero
    dtype = x_ptr.dtype.element_ty
    IS_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    H_MAGIC: tl.constexpr = 0x4300 if IS_BF16 else 0x6400  # half2 magic: 128 (bf16) / 1024 (fp16)
    if DOT_F32:  # interpreter only
        dot_dtype = tl.float32
    else:
        dot_dtype = dtype

    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_r = tl.arange(0, IB)  # [IB]
    mask_m = offs_m < M
    if EVEN_N:
        mask_n = tl.full((BLOCK_N,), 1, tl.int1)
    else:
        mask_n = offs_n < N
    num_k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    tiles_per_split = (num_k_tiles + split_k - 1) // split_k
    kt_start = pid_k * tiles_per_split
    kt_end = tl.minimum(kt_start + tiles_per_split, num_k_tiles)

    if USE_DOT:
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc2 = tl.zeros((IB, BLOCK_N), dtype=tl.float32)

    for kt in range(kt_start, kt_end):
        k0 = kt * BLOCK_K
        w = tl.load(
            qw_ptr + (kt * IB + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn,
            mask=mask_n[None, :],
            other=0,
        )  # [IB, BLOCK_N] int32 (K is padded to whole tiles)
        # Zero points: fp32 "2**23 + z" (zm) for the FMA / fallback path, half2 "M + z" (zz) for FAST.
        if SCALE_PER_TILE:
            g = k0 // group_size
            s_tile = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
            s_tile = s_tile.to(tl.float32)[None, :]  # [1, BLOCK_N]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0).to(tl.int32)
                zm = (z | 0x4B000000).to(tl.float32, bitcast=True)[None, :]  # [1, BLOCK_N]
                zz = tl.broadcast_to(((z | H_MAGIC) * 0x10001)[None, :], (IB, BLOCK_N))
            else:
                zm = SYM_ZM
                zz = tl.full((IB, BLOCK_N), (H_MAGIC + (1 << (BITS - 1))) * 0x10001, tl.int32)
        else:
            if HAS_ZEROS:
                zm = 8388608.0  # zero subtracted per code position below
                zz = tl.full((IB, BLOCK_N), H_MAGIC * 0x10001, tl.int32)
            else:
                zm = SYM_ZM
                zz = tl.full((IB, BLOCK_N), (H_MAGIC + (1 << (BITS - 1))) * 0x10001, tl.int32)
        if IS_BF16:
            zz = zz ^ -2147450880  # 0x80008000 as int32: negate both halves for the bf16 fma

        if USE_DOT and FAST:
            codes = _codes_fast(w, zz, BITS, IS_BF16)
        elif CAT:
            codes = _codes_slow(w, zm, BITS, dot_dtype)
        if USE_DOT and SCALE_PER_TILE:
            if SWAP_AB:
                part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            else:
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if not USE_DOT and SCALE_PER_TILE:
            part2 = tl.zeros((IB, BLOCK_N), dtype=tl.float32)

        if CAT:  # SCALE_PER_TILE only (the launcher guarantees it)
            if BITS == 4:
                b = _cat_rows(
                    _cat_rows(_cat_rows(codes[0], codes[1]), _cat_rows(codes[2], codes[3])),
                    _cat_rows(_cat_rows(codes[4], codes[5]), _cat_rows(codes[6], codes[7])),
                )  # [BLOCK_K, BLOCK_N]
            else:
                b = _cat_rows(_cat_rows(codes[0], codes[1]), _cat_rows(codes[2], codes[3]))
            offs_kk = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            if HAS_PERM:
                src_kk = tl.load(perm_ptr + offs_kk, mask=offs_kk < K, other=0)
            else:
                src_kk = offs_kk
            xk = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + src_kk[None, :] * stride_xk,
                mask=mask_m[:, None] & (offs_kk < K)[None, :],
                other=0.0,
            ).to(dot_dtype)  # [BLOCK_M, BLOCK_K]
            b = b.to(dot_dtype)
            if SWAP_AB:
                part = tl.dot(tl.trans(b), tl.trans(xk), part)
            else:
                part = tl.dot(xk, b, part)
        for j in tl.static_range(0 if CAT else PF):
            kj = k0 + j * IB  # first packed row of this code position's slice
            offs_k = kj + offs_r  # [IB] contiguous packed rows
            if EVEN_K:
                mask_k = tl.full((IB,), 1, tl.int1)
            else:
                mask_k = offs_k < K
            if HAS_PERM:
                src = tl.load(perm_ptr + offs_k, mask=mask_k, other=0)
            else:
                src = offs_k
            if not SCALE_PER_TILE:  # the IB rows of slice j lie in one group (IB divides G)
                gj = kj // group_size
                mask_nj = offs_n < tl.where(kj < K, N, 0)  # mask_n, empty past K (no scalar bool broadcast)
                s_j = tl.load(scales_ptr + gj * stride_sg + offs_n * stride_sn, mask=mask_nj, other=0.0)
                if HAS_ZEROS:
                    z_j = tl.load(zeros_ptr + gj * stride_zg + offs_n * stride_zn, mask=mask_nj, other=0)
            if USE_DOT:
                xj = tl.load(
                    x_ptr + offs_m[:, None] * stride_xm + src[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0,
                ).to(dot_dtype)  # [BLOCK_M, IB]
                if FAST:
                    b = codes[j]  # [IB, BLOCK_N] q - zero, exact
                else:
                    b = _code_f32(w, j, zm, BITS)
                if not SCALE_PER_TILE:
                    if HAS_ZEROS:
                        b = (b - z_j.to(b.dtype)[None, :]) * s_j.to(b.dtype)[None, :]
                    else:
                        b = b * s_j.to(b.dtype)[None, :]
                b = b.to(dtype).to(dot_dtype)
                if SCALE_PER_TILE:
                    if SWAP_AB:
                        part = tl.dot(tl.trans(b), tl.trans(xj), part)
                    else:
                        part = tl.dot(xj, b, part)
                else:
                    if SWAP_AB:
                        acc = tl.dot(tl.trans(b), tl.trans(xj), acc)
                    else:
                        acc = tl.dot(xj, b, acc)
            else:
                xj = tl.load(x_ptr + src * stride_xk, mask=mask_k, other=0.0).to(tl.float32)  # [IB] (M == 1)
                if SCALE_PER_TILE:
                    part2 += xj[:, None] * _code_f32(w, j, zm, BITS)
                else:
                    if HAS_ZEROS:
                        zm_j = (z_j.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)[None, :]
                    else:
                        zm_j = zm
                    acc2 += (xj[:, None] * _code_f32(w, j, zm_j, BITS)) * s_j.to(tl.float32)[None, :]

        if USE_DOT and SCALE_PER_TILE:
            if SWAP_AB:
                acc += part * tl.trans(s_tile)
            else:
                acc += part * s_tile
        if not USE_DOT and SCALE_PER_TILE:
            acc2 += part2 * s_tile

    if USE_DOT:
        if SWAP_AB:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        acc = tl.sum(acc2, axis=0)[None, :]  # [1, BLOCK_N]
    _finish_tile(
        acc,
        offs_m,
        offs_n,
        M,
        N,
        bias_ptr,
        out_ptr,
        ws_ptr,
        cnt_ptr,
        split_k,
        pid_k,
        pid_m * tl.num_programs(0) + pid_n,
        stride_om,
        stride_on,
        stride_wsk,
        stride_wsm,
        HAS_BIAS,
        USE_SPLIT,
        BLOCK_M,
        BLOCK_N,
    )


@triton.jit
def w4a16_dequant_kernel(
    qw_ptr,  # int32 [K_pad // PF, N], tile-interleaved
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # uint8 [num_groups, N] (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    out_ptr,  # [K, N] dense weight in input row order
    N,
    K,
    group_size,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_ok,
    stride_on,
    BITS: tl.constexpr,
    IB: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    SYM_ZM: tl.constexpr = 8388608.0 + (1 << (BITS - 1))
    dtype = out_ptr.dtype.element_ty
    kt = tl.program_id(0)
    offs_r = tl.arange(0, IB)  # [IB]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_n = offs_n < N
    w = tl.load(
        qw_ptr + (kt * IB + offs_r)[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_n[None, :], other=0
    )  # [IB, BLOCK_N]
    for j in tl.static_range(PF):
        rows = kt * PF * IB + j * IB + offs_r  # [IB] packed rows of code position j
        mask_k = rows < K
        mask = mask_k[:, None] & mask_n[None, :]
        g = rows // group_size
        s = tl.load(scales_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask, other=0.0)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + g[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=mask, other=0)
            zm = (z.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        else:
            zm = SYM_ZM
        val = _code_f32(w, j, zm, BITS) * s.to(tl.float32)  # [IB, BLOCK_N]
        if HAS_PERM:
            rows = tl.load(perm_ptr + rows, mask=mask_k, other=0)
        tl.store(out_ptr + rows[:, None] * stride_ok + offs_n[None, :] * stride_on, val.to(dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """One launch configuration. ``kind``: "fused" (w4a16_gemm_kernel) or "dequant" (+ cuBLAS).

    BLOCK_K is not a knob: it is the layout's K-tile (``TiledQuantWeight.block_k``).
    """

    kind: str = "fused"
    use_dot: bool = False
    swap_ab: bool = False
    block_m: int = 1
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    cat: bool = False  # one [BLOCK_K, BLOCK_N] dot per K-tile instead of PF thin ones (dot path)

    def short(self) -> str:
        if self.kind == "dequant":
            return "dequant+mm"
        mode = ("dotT" if self.swap_ab else "dot") if self.use_dot else "fma"
        mode += "C" if self.cat else ""
        return f"{mode} m{self.block_m} n{self.block_n} s{self.split_k} w{self.num_warps} st{self.num_stages}"


DEQUANT = W4A16Config(kind="dequant")

# Tuned configs: (device index, K, N, bits, group_size, dtype, m_bucket) -> config. Filled by
# ``tune_w4a16`` (or ``set_config``) before CUDA-graph capture; read-only on the hot path.
_TUNED: dict[tuple, W4A16Config] = {}

# Split-K reduction uses per-tile counters; the prepared weight holds this many per N-column of
# tiles at the smallest BLOCK_N allowed to split (see ``num_split_counters``).
MAX_SPLIT_M_TILES = 4
MIN_SPLIT_BLOCK_N = 32


def num_split_counters(n: int) -> int:
    """Arrival counters a weight of N columns needs for every split-K config we launch."""
    return triton.cdiv(n, MIN_SPLIT_BLOCK_N) * MAX_SPLIT_M_TILES


def m_bucket(m: int) -> int:
    """Power-of-two bucket of M used as the config-cache key (1, 2, 4, ... 4096, then capped)."""
    return min(1 << max(0, (m - 1).bit_length()), 8192)


def _fix(cfg: W4A16Config, m: int, k: int, n: int, block_k: int) -> W4A16Config:
    """Clamp a config to what the kernel allows for this problem (valid for any M in the bucket)."""
    if cfg.kind != "fused":
        return cfg
    if not cfg.use_dot and m > 1:  # the FMA path is a GEMV
        block_m = max(16, triton.next_power_of_2(m)) if m <= 64 else 64
        cfg = dataclasses.replace(cfg, use_dot=True, block_m=block_m)
    if cfg.use_dot and cfg.block_m < 16:
        cfg = dataclasses.replace(cfg, block_m=16)
    split = max(1, min(cfg.split_k, triton.cdiv(k, block_k)))
    if split > 1 and (cfg.block_n < MIN_SPLIT_BLOCK_N or triton.cdiv(m, cfg.block_m) > MAX_SPLIT_M_TILES):
        split = 1
    return dataclasses.replace(cfg, split_k=split)


def default_config(m: int, k: int, n: int, block_k: int) -> W4A16Config:
    """Built-in choice by M: the winners of ``bench/kernels.py --sweep`` on an H200 (Qwen2.5-14B shapes,
    bench/RESULTS.md), written as rules so that other shapes get the same kind of launch.

    M <= 16: tensor-core dequant-GEMM with M padded to 16 (cheaper per code than CUDA-core FMAs
    once the dequant is 1.4 instructions/code), split-K until ~200 programs are in flight.
    17..128: one K=BLOCK_K wgmma per tile with the weight as the register A operand (swap + cat).
    > 128: dequantize to a dense fp16/bf16 weight, then cuBLAS.
    """
    if m <= 16:
        block_n = 256 if n >= 16384 else 128
        cfg = W4A16Config(use_dot=True, block_m=16, block_n=block_n, num_warps=4, num_stages=3)
    elif m <= 64:
        block_m = 32 if m <= 32 else 64
        block_n = 128 if (m > 32 and n >= 16384) else 64
        cfg = W4A16Config(use_dot=True, swap_ab=True, block_m=block_m, block_n=block_n, num_stages=3, cat=True)
    elif m <= 128:
        if n >= 16384:
            cfg = W4A16Config(use_dot=True, swap_ab=True, block_m=128, block_n=128, num_warps=8, num_stages=3, cat=True)
        else:
            cfg = W4A16Config(use_dot=True, swap_ab=True, block_m=64, block_n=64, num_stages=3, cat=True)
    else:
        return DEQUANT
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    split = 1
    while tiles * split < 200 and split < 8:
        split *= 2
    return _fix(dataclasses.replace(cfg, split_k=split), m, k, n, block_k)


def _key(device: torch.device, weight: TiledQuantWeight, dtype: torch.dtype, m: int) -> tuple:
    index = device.index if device.type == "cuda" else -1
    return (index, weight.in_features, weight.out_features, weight.bits, weight.group_size, dtype, m_bucket(m))


def set_config(weight: TiledQuantWeight, dtype: torch.dtype, m: int, cfg: W4A16Config) -> None:
    """Pin the config for this weight's shape and M bucket (used by tuning and benchmarks)."""
    _TUNED[_key(weight.qweight.device, weight, dtype, m)] = cfg


def select_config(weight: TiledQuantWeight, dtype: torch.dtype, m: int) -> W4A16Config:
    """Pure dict lookup + arithmetic: safe on the hot path and under CUDA-graph capture."""
    k, n = weight.in_features, weight.out_features
    cfg = _TUNED.get(_key(weight.qweight.device, weight, dtype, m))
    if cfg is None:
        cfg = default_config(m, k, n, weight.block_k)
    return _fix(cfg, m, k, n, weight.block_k)


def candidate_configs(m: int, k: int, n: int, block_k: int) -> list[W4A16Config]:
    """Configs worth timing for this M (the benchmark and ``tune_w4a16`` sweep these)."""
    out: list[W4A16Config] = []
    splits = (1, 2, 4, 8)
    if m == 1:
        for block_n in (128, 256):
            for split in (1, 4):
                out.append(W4A16Config("fused", False, False, 1, block_n, split, 4, 2))
    if m <= 128:
        block_m = max(16, triton.next_power_of_2(min(m, 64)))
        for swap in (False, True):
            for block_n in (64, 128, 256):
                for split in splits:
                    out.append(W4A16Config("fused", True, swap, block_m, block_n, split, 4, 3))
    if 8 <= m <= 128:  # one K=BLOCK_K dot per tile (wgmma with the weight as A from registers)
        block_m = max(16, triton.next_power_of_2(min(m, 64)))
        for swap, block_n in ((True, 64), (True, 128), (False, 128)):
            for split in (1, 2, 4):
                out.append(W4A16Config("fused", True, swap, block_m, block_n, split, 4, 3, cat=True))
    if m >= 128:
        for block_m, block_n, warps in ((64, 128, 4), (128, 128, 8), (128, 256, 8)):
            out.append(W4A16Config("fused", True, False, block_m, block_n, 1, warps, 3))
        for block_m, block_n, warps, stages in ((128, 128, 8, 3), (256, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 4)):
            out.append(W4A16Config("fused", True, True, block_m, block_n, 1, warps, stages, cat=True))
        out.append(DEQUANT)
    uniq: list[W4A16Config] = []
    for cfg in out:
        cfg = _fix(cfg, m, k, n, block_k)
        if cfg not in uniq:
            uniq.append(cfg)
    return uniq


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def supports(weight: PackedQuantWeight) -> bool:
    """Whether the Triton kernels serve this weight (else the caller uses the reference)."""
    g, k = weight.group_size, weight.in_features
    return g >= k or g % DEFAULT_INTERLEAVE == 0


def prepare(weight: PackedQuantWeight) -> TiledQuantWeight:
    """Load-time: canonical -> the kernels' tile-interleaved layout (quant_kernels.repack)."""
    if not supports(weight):
        raise ValueError(f"group_size={weight.group_size} is not a multiple of {DEFAULT_INTERLEAVE}")
    return tile_interleave(weight, DEFAULT_INTERLEAVE)


def _fast_ok(bits: int, dtype: torch.dtype) -> bool:
    return not _INTERPRET and ((bits == 4 and dtype in _F16_MAGIC) or (bits == 8 and dtype == torch.float16))


def dequantize_dense(weight: TiledQuantWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense ``[K, N]`` weight in *input* row order (perm undone), in ``dtype``."""
    k, n = weight.in_features, weight.out_features
    if out is None:
        out = torch.empty((k, n), dtype=dtype, device=weight.qweight.device)  # [K, N]
    block_n = 128
    qw, sc = weight.qweight, weight.scales
    device = qw.device
    # typed placeholders for the arguments this launch leaves unused (quant_kernels.device)
    zeros = weight.zeros if weight.zeros is not None else kdevice.placeholder(device, torch.uint8)
    perm = weight.perm if weight.perm is not None else kdevice.placeholder(device, torch.int64)
    zero_strides = weight.zeros.stride() if weight.zeros is not None else (0, 0)
    grid = (qw.shape[0] // weight.interleave, triton.cdiv(n, block_n))
    w4a16_dequant_kernel[grid](
        qw,
        sc,
        zeros,
        perm,
        out,
        n,
        k,
        weight.group_size,
        qw.stride(0),
        qw.stride(1),
        sc.stride(0),
        sc.stride(1),
        *zero_strides,
        out.stride(0),
        out.stride(1),
        BITS=weight.bits,
        IB=weight.interleave,
        HAS_ZEROS=weight.zeros is not None,
        HAS_PERM=weight.perm is not None,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def w4a16_gemm(
    x: torch.Tensor,  # [M, K] fp16 / bf16
    weight: TiledQuantWeight,
    bias: torch.Tensor | None = None,  # [N]
    config: W4A16Config | None = None,
    counters: torch.Tensor | None = None,  # int32 [>= num_split_counters(N)], zeros; reused across calls
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """``x[:, perm] @ dequant(weight) + bias`` on CUDA (or under TRITON_INTERPRET=1); returns ``[M, N]``."""
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"x has K={k}, weight has in_features={weight.in_features}")
    block_k = weight.block_k
    cfg = select_config(weight, x.dtype, m) if config is None else _fix(config, m, k, n, block_k)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return out
    if cfg.kind == "dequant":
        dense = dequantize_dense(weight, x.dtype)  # [K, N] input order: no gather of x
        if bias is None:
            return torch.mm(x, dense, out=out)
        return torch.addmm(bias.to(x.dtype), x, dense, out=out)

    split = cfg.split_k
    num_pid_m = triton.cdiv(m, cfg.block_m)
    num_pid_n = triton.cdiv(n, cfg.block_n)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)  # [split_k, M, N]
        if counters is None:
            counters = torch.zeros(num_pid_m * num_pid_n, dtype=torch.int32, device=x.device)
        elif counters.numel() < num_pid_m * num_pid_n:
            raise ValueError(f"counters hold {counters.numel()} entries, need {num_pid_m * num_pid_n}")
    else:  # typed placeholders for the arguments this launch leaves unused (quant_kernels.device)
        ws = kdevice.placeholder(x.device, torch.float32)
        counters = counters if counters is not None else kdevice.placeholder(x.device, torch.int32)
    if counters.dtype != torch.int32:
        raise ValueError(f"counters must be int32, got {counters.dtype}")
    qw, sc = weight.qweight, weight.scales
    zeros = weight.zeros if weight.zeros is not None else kdevice.placeholder(x.device, torch.uint8)
    perm = weight.perm if weight.perm is not None else kdevice.placeholder(x.device, torch.int64)
    bias_arg = bias if bias is not None else kdevice.placeholder(x.device, x.dtype)
    zero_strides = weight.zeros.stride() if weight.zeros is not None else (0, 0)
    grid = (num_pid_n, split, num_pid_m)
    w4a16_gemm_kernel[grid](
        x,
        qw,
        sc,
        zeros,
        perm,
        bias_arg,
        out,
        ws,
        counters,
        m,
        n,
        k,
        weight.group_size,
        split,
        x.stride(0),
        x.stride(1),
        qw.stride(0),
        qw.stride(1),
        sc.stride(0),
        sc.stride(1),
        *zero_strides,
        out.stride(0),
        out.stride(1),
        ws.stride(0) if split > 1 else 0,
        ws.stride(1) if split > 1 else 0,
        BITS=weight.bits,
        IB=weight.interleave,
        HAS_ZEROS=weight.zeros is not None,
        HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None,
        SCALE_PER_TILE=weight.group_size % block_k == 0,
        USE_DOT=cfg.use_dot,
        SWAP_AB=cfg.swap_ab,
        CAT=cfg.use_dot and cfg.cat and weight.group_size % block_k == 0,
        FAST=cfg.use_dot and _fast_ok(weight.bits, x.dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        USE_SPLIT=split > 1,
        EVEN_K=k % block_k == 0,
        EVEN_N=n % cfg.block_n == 0,
        DOT_F32=_INTERPRET and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def tune_w4a16(
    weight: TiledQuantWeight,
    dtype: torch.dtype,
    ms: list[int],
    counters: torch.Tensor | None = None,
    rep_ms: int = 20,
) -> dict[int, W4A16Config]:
    """Time ``candidate_configs`` for each M and pin the fastest (call before graph capture)."""
    from triton.testing import do_bench

    chosen: dict[int, W4A16Config] = {}
    k, n = weight.in_features, weight.out_features
    for m in ms:
        x = torch.randn((m, k), dtype=dtype, device=weight.qweight.device)  # [M, K]
        best: tuple[float, W4A16Config] | None = None
        for cfg in candidate_configs(m, k, n, weight.block_k):
            try:
                t = do_bench(lambda cfg=cfg, x=x: w4a16_gemm(x, weight, None, cfg, counters), rep=rep_ms)
            except Exception:  # a config the compiler rejects (resources) is skipped
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            set_config(weight, dtype, m, best[1])
            chosen[m] = best[1]
    return chosen
