"""Gluon W4A16 GEMM for Hopper (sm90) where the card is busy (the default dispatch: 65-512 rows): each
K-tile's wgmma runs while the next tile is dequantized.

Knows: the MMA-operand layout of ``quant_kernels.repack.MmaQuantWeight`` (4-bit, ``kwidth`` 2: the
layout ``w4a16_mma_triton`` reads), Hopper's wgmma / TMA / mbarrier through
``triton.experimental.gluon``, and how to tile one ``(M, K, N)``. Must not know: models, checkpoint
formats, engines, the dispatch table (``w4a16_mma_triton.select_config`` owns it).

Why a second kernel of the same op. ``w4a16_mma_kernel`` (Triton's frontend) waits for every K-tile's
wgmma before it dequantizes the next tile: left in flight across the loop's back edge, ptxas reused the
registers of the in-register A operand while the wgmma still read them (wrong output on the H200,
bench/RESULTS.md). So at 128 rows and more its tensor cores idle while the same warps dequantize, and
it lost to dense weights + cuBLAS past 256 rows (issue 26). Gluon states what the frontend could not:

- the weight tile's words arrive by TMA into a ring of ``STAGES`` shared buffers beside the
  activation tile, one mbarrier per stage;
- the words are read to registers in the layout whose dequant + ``reshape``/``permute`` (the same
  unshuffle as the Triton kernel) *is* wgmma's A-operand layout (``convert_layout(...,
  assert_trivial=True)`` fails the compile otherwise), scaled (and zero-shifted) there;
- ``warpgroup_mma(..., is_async=True)`` then ``warpgroup_mma_wait(1, deps=(acc, a_prev))``: the
  previous tile's MMA is done before its stage is refilled, and the previous A operand stays a live
  value (a loop-carried tensor passed through the wait) until then, so its registers cannot be
  reused under the running wgmma;
- scales go on the weight values (``(q - z) * s`` rounded once to the activation dtype, as the
  reference dequantizes), so the MMAs chain on one fp32 accumulator; each tile's scales (and zeros)
  are loaded two steps ahead, in registers (waiting on them was the loop's largest stall).

The output tile leaves through shared memory by TMA (rows and columns past M / N are clipped by the
copy). With ``split_k > 1`` each K share stores its fp32 partial into a slot of its own (in the
accumulator's layout: whole 32-byte sectors), then counts itself on its tile's arrival counter; the
last share sums every share's partial in share order (the same bits whichever share arrives last), adds
the bias and writes the tile, and leaves the counter at zero (one launch, no memset; the pattern of
``w4a16_mma_triton``). ``auto_split`` picks the shares where the tiles leave SMs idle (o and down 3, qkv 2
at 33-128 rows; the long-K down 3 up to 512), measured on the H100 (twenty-first and twenty-second
sessions); ``QSERVE_W4A16_GLUON_SPLIT=1`` never splits, ``=N`` forces N. Summing in arrival order (the
others' partials onto the last share's own) made the output's last bit vary from run to run with 3 or
more shares and was no faster (twenty-second session); the fp32-atomic split before it lost 1.3-7x.
At 33-64 rows the x tiles are 64 rows in 4 stages (the narrow launch). A stream-K variant (the product's
tile x K-tile iterations cut into equal runs over two programs an SM, aimed at the partial last wave) lost
18-68% to this launch at every layer at 128-512 rows on the H100 and was deleted (twenty-third session,
bench/RESULTS.md: ncu put its L2 at 81% against the split's 65%). Serves 4-bit weights
without act-order whose K-tiles lie in one group (group size a multiple of ``block_k``, or one group
per column), fp16/bf16 activations; ``supports`` says which. ``w4a16_mma_triton.uses_gluon`` decides
when it runs (where it beat the other paths on the H100, bench/RESULTS.md, twentieth and twenty-first
sessions). What
limits it (ncu, 1,024 rows of gate_up on the H100): the one-warpgroup 128 x 64 tiles read x from L2
once per 64 weight rows (L2 at 85% of its peak, tensor pipe 65%); the 8-warp 128 x 128 tiles halve
that but hold both warpgroups to one CTA barrier before every refill; one warpgroup on 128 weight rows halves
it too: with 128-deep K-tiles ptxas serializes its wgmmas (C7511, twenty-second session), and with 64-deep
ones (``QSERVE_W4A16_GLUON_TILE=128x128x64x3x4``) it compiles but lost at 128-256 rows and tied at 512
(twenty-third session: twice the steps, half the programs). A warp-specialized variant (a
loader warp issuing the TMA copies beside the 8 consumer warps; twentieth session) was 1-11% faster than
the same 8-warp tiles but slower than the one-warpgroup tiles at every shape measured (1-11% at 256-1,024
rows, up to 47% at 128), and was deleted:
in Triton 3.6 a partition's warps still synchronize around every mbarrier wait and arrive, and a
consumer partition per warpgroup compiled with every wgmma serialized (ptxas C7512).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from quant_kernels import device as kdevice
from quant_kernels import int4_values_asm
from quant_kernels.repack import MmaQuantWeight


@dataclass(frozen=True)
class WgmmaConfig:
    """One launch of ``w4a16_wgmma_kernel``. The defaults are the built-in dispatch's: one warpgroup on
    128 x 64 tiles in 3 stages (110 KB of shared memory, 188-199 registers), so two programs share an SM and
    each waits at its own barriers while the other's wgmmas run; it beat the 8-warp 128 x 128 tiles at
    128-1,024 rows of every Qwen2.5-14B layer on the H100 (bench/RESULTS.md, twentieth session). The scales
    two K-tiles ahead took 2-8% off every shape of the twenty-first session's run; ``default_config`` sets
    the K shares (``auto_split``)."""

    block_m: int = 128  # rows of x per program (the wgmma's N: 64-256)
    block_n: int = 64  # output columns per program (the wgmma's M: 16 per warp of a warpgroup)
    block_k: int = 128
    stages: int = 3
    num_warps: int = 4
    split_k: int = 1
    scales_ahead: int = 2  # K-tiles ahead each tile's scales are loaded (1 or 2)

    def short(self) -> str:
        return (
            f"gluon m{self.block_m} n{self.block_n} k{self.block_k} st{self.stages} w{self.num_warps} "
            f"s{self.split_k} a{self.scales_ahead}"
        )


# ----------------------------------------------------------------------------------------------
# Layouts (compile time)
# ----------------------------------------------------------------------------------------------


@gluon.constexpr_function
def _word_layout(BLOCK_N, BLOCK_K, num_warps):
    """The register layout of one K-tile's words ``[BLOCK_N / 4, BLOCK_K / 2]`` whose dequant and
    unshuffle is wgmma's A operand with no data movement: each thread 4 contiguous words (16 bytes;
    8 lanes a 128-byte line), then the next 64-value k chunks, then the next 16-row blocks of its warp
    (read from Triton's own choice for ``w4a16_mma_kernel``, sm90 TTGIR)."""
    rows, words = BLOCK_N // 4, BLOCK_K // 2
    reg = [[0, 1], [0, 2]]
    w = 32
    while w < words:
        reg.append([0, w])
        w *= 2
    r = 4 * num_warps
    while r < rows:
        reg.append([r, 0])
        r *= 2
    warp = []
    r = 4
    while r < 4 * num_warps:
        warp.append([r, 0])
        r *= 2
    lane = [[0, 4], [0, 8], [0, 16], [1, 0], [2, 0]]
    return gl.DistributedLinearLayout(reg, lane, warp, [], [rows, words])


@gluon.constexpr_function
def _mma_layout(BLOCK_M, num_warps):
    """The accumulator ``[BLOCK_N, BLOCK_M]``: warps stacked along the weight rows, one wgmma as wide as
    the row tile of x (at most 256)."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, min(BLOCK_M, 256), 16]
    )


# ----------------------------------------------------------------------------------------------
# Device functions
# ----------------------------------------------------------------------------------------------


# The CTA barrier: ``gl.thread_barrier`` in Triton 3.6 (the device's), ``gl.barrier`` from 3.7 on.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
BF16_VALUES4_ASM = gl.constexpr(int4_values_asm.BF16_VALUES4)
FP16_VALUES4_ASM = gl.constexpr(int4_values_asm.FP16_VALUES4)


@gluon.jit
def _values4(w, IS_BF16: gl.constexpr):
    """The 8 values of each 4-bit word as fp16/bf16 ``q - 8`` in word-value order (exact; the PTX of
    ``quant_kernels.int4_values_asm``, as ``w4a16_mma_triton._values_fast4``)."""
    if IS_BF16:
        return gl.inline_asm_elementwise(
            BF16_VALUES4_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1
        )
    else:
        return gl.inline_asm_elementwise(
            FP16_VALUES4_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w], dtype=(gl.float16,) * 8, is_pure=True, pack=1
        )


@gluon.jit
def _weight_operand(
    words,  # int32 [BLOCK_N / 4, BLOCK_K / 2] in _word_layout
    s,  # [BLOCK_N] scales of this K-tile's group
    z,  # [BLOCK_N] z - 8 (HAS_ZEROS), else unused
    A_LAYOUT: gl.constexpr,
    HAS_ZEROS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    dtype: gl.constexpr,
):
    """``(q - z) * s`` as wgmma's A operand ``[BLOCK_N, BLOCK_K]`` (registers)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = _values4(words, dtype == gl.bfloat16)
    t = gl.join(
        gl.join(gl.join(v0, v4), gl.join(v2, v6)),
        gl.join(gl.join(v1, v5), gl.join(v3, v7)),
    )  # [R, C, 2, 2, 2]: index (b0, b1, b2) holds v_(4*b0 + 2*b1 + b2)
    v = gl.reshape(t, (BLOCK_N // 16, 4, BLOCK_K // 64, 2, 4, 4, 2, 2, 2))  # stored order, kwidth 2
    v = gl.permute(v, (0, 7, 1, 3, 2, 5, 6, 4, 8))  # the inverse of repack.mma_shuffle
    wt = gl.convert_layout(gl.reshape(v, (BLOCK_N, BLOCK_K)), A_LAYOUT, assert_trivial=True)
    if dtype == gl.float16:  # q - z is exact in fp16 and the product is rounded once: packed half math
        if HAS_ZEROS:
            wt = wt - gl.expand_dims(z.to(gl.float16), 1)
        return wt * gl.expand_dims(s.to(gl.float16), 1)
    else:  # bf16: the fp16 scale has more mantissa than bf16; one rounding of the fp32 product
        wt = wt.to(gl.float32)
        if HAS_ZEROS:
            wt = wt - gl.expand_dims(z.to(gl.float32), 1)
        return (wt * gl.expand_dims(s.to(gl.float32), 1)).to(dtype)


@gluon.jit
def _load_tile(t, ok, ring):
    """Issue the TMA copies of this program's tile ``t`` (x and weight words) into stage ``t % STAGES`` of
    ``ring`` = ``(x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count)``, when ``ok``."""
    x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count = ring
    stage = t % x_smem.shape[0]
    bar = bars.index(stage)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=ok)
    k_tile = kt0 + t
    tma.async_copy_global_to_shared(
        x_desc, [off_m, k_tile * x_desc.block_type.shape[1]], bar, x_smem.index(stage), pred=ok
    )
    tma.async_copy_global_to_shared(
        w_desc,
        [pid_n * w_desc.block_type.shape[0], k_tile * w_desc.block_type.shape[1]],
        bar,
        w_smem.index(stage),
        pred=ok,
    )


@gluon.jit
def _group_params(t, params, HAS_ZEROS: gl.constexpr, GROUP_TILES: gl.constexpr):
    """The scales (and ``z - 8``) of the group that holds this program's tile ``t``, as two
    ``[BLOCK_N]`` vectors; ``params`` = ``(scales_ptr, zeros_ptr, offs_n, mask_n, kt0, stride_sg,
    stride_zg)``. ``GROUP_TILES`` K-tiles share a group (0: one group for all of K)."""
    scales_ptr, zeros_ptr, offs_n, mask_n, kt0, stride_sg, stride_zg = params
    if GROUP_TILES == 0:
        g = 0
    else:
        g = (kt0 + t) // GROUP_TILES  # a constant divisor: a shift for the usual 1 or 2
    s = gl.load(scales_ptr + g * stride_sg + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
    if HAS_ZEROS:
        z = gl.load(zeros_ptr + g * stride_zg + offs_n, mask=mask_n, other=0.0)  # [BLOCK_N]
    else:
        z = s
    return s, z


@gluon.jit
def _step(
    i,  # this program's tile number (0 .. count - 1)
    acc,
    sz,  # SCALES_AHEAD (s, z) pairs in flight: tile i's first (one pair: the pair itself)
    ring,  # (x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count): _load_tile's
    params,  # _group_params's
    A_LAYOUT: gl.constexpr,
    WORD_LAYOUT: gl.constexpr,
    HAS_ZEROS: gl.constexpr,
    GROUP_TILES: gl.constexpr,
    SCALES_AHEAD: gl.constexpr,
):
    """One K-tile: start the next tile's scale loads, wait for this tile's stage, dequantize, issue its
    wgmma, wait for the previous tile's, refill that tile's stage with tile ``i + STAGES - 1``. Returns
    ``(acc, the pairs in flight for tile i + 1)``.

    The scales travel ``SCALES_AHEAD`` tiles ahead in registers: loaded in the step that uses them, their
    global load's latency was the largest stall of the loop (ncu at 1,024 rows of gate_up on the H100: 23% of
    the warp samples on the scale multiply, waiting on the load). One tile ahead still left 8-10% of the
    samples there at 256 rows; two (the default launch's since the twenty-first session) took 2-8% off every
    shape measured."""
    x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count = ring
    STAGES: gl.constexpr = x_smem.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = 4 * w_desc.block_type.shape[0]
    stage = i % STAGES
    incoming = _group_params(gl.minimum(i + SCALES_AHEAD, count - 1), params, HAS_ZEROS, GROUP_TILES)
    if SCALES_AHEAD == 1:
        s, z = sz
        sz_next = incoming
    else:  # 2: two tiles ahead
        first, second = sz
        s, z = first
        sz_next = (second, incoming)
    mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
    words = w_smem.index(stage).load(WORD_LAYOUT)
    a = _weight_operand(words, s, z, A_LAYOUT, HAS_ZEROS, BLOCK_N, BLOCK_K, x_desc.dtype)
    acc = warpgroup_mma(a, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # tile i - 1's MMA is done: its stage is free
    _load_tile(i + STAGES - 1, i + STAGES - 1 < count, ring)
    return acc, sz_next


@gluon.jit
def _main_loop(
    ring,  # (x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count): _load_tile's
    scales_ptr,
    zeros_ptr,
    N,
    stride_sg,
    stride_zg,
    MMA_LAYOUT: gl.constexpr,
    A_LAYOUT: gl.constexpr,
    WORD_LAYOUT: gl.constexpr,
    HAS_ZEROS: gl.constexpr,
    GROUP_TILES: gl.constexpr,
    SCALES_AHEAD: gl.constexpr,
):
    """This program's ``count`` K-tiles from ``kt0`` of one output tile: the ring's barriers set up, its first
    ``STAGES - 1`` tiles requested, every tile dequantized into its wgmma (``_step``), the last wgmma waited
    for and the barriers released; returns the fp32 accumulator ``[BLOCK_N, BLOCK_M]``.

    Two tiles per iteration, each through its own call site: tile i's A operand (registers read by its
    wgmma until the wait one tile later) and tile i + 1's are different values, so the PTX never redefines
    an A register under a wgmma in flight (one call site in a rolled loop writes the same virtual registers
    every iteration: the race the Triton kernel met). The first tile is peeled so that every path reaches
    the last wait through a wgmma."""
    x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count = ring
    STAGES: gl.constexpr = x_smem.shape[0]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = 4 * w_desc.block_type.shape[0]
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        _load_tile(i, i < count, ring)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_LAYOUT))  # [BLOCK_N]
    mask_n = offs_n < N
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA_LAYOUT)
    params = (scales_ptr, zeros_ptr, offs_n, mask_n, kt0, stride_sg, stride_zg)
    sz = _group_params(0, params, HAS_ZEROS, GROUP_TILES)
    if SCALES_AHEAD == 2:
        sz = (sz, _group_params(gl.minimum(1, count - 1), params, HAS_ZEROS, GROUP_TILES))
    acc, sz = _step(0, acc, sz, ring, params, A_LAYOUT, WORD_LAYOUT, HAS_ZEROS, GROUP_TILES, SCALES_AHEAD)
    for j in range((count - 1) // 2):
        acc, sz = _step(2 * j + 1, acc, sz, ring, params, A_LAYOUT, WORD_LAYOUT, HAS_ZEROS, GROUP_TILES, SCALES_AHEAD)
        acc, sz = _step(2 * j + 2, acc, sz, ring, params, A_LAYOUT, WORD_LAYOUT, HAS_ZEROS, GROUP_TILES, SCALES_AHEAD)
    if count % 2 == 0:
        acc, sz = _step(count - 1, acc, sz, ring, params, A_LAYOUT, WORD_LAYOUT, HAS_ZEROS, GROUP_TILES, SCALES_AHEAD)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    return acc


@gluon.jit
def w4a16_wgmma_kernel(
    x_desc,  # TMA [M, K] fp16/bf16, block [BLOCK_M, BLOCK_K]
    w_desc,  # TMA int32 [N_pad / 4, K_pad / 2], block [BLOCK_N / 4, BLOCK_K / 2]
    out_desc,  # TMA [M, N], block [BLOCK_M, BLOCK_N]
    scales_ptr,  # [groups, N]
    zeros_ptr,  # fp16 [groups, N]: z - 8 (HAS_ZEROS)
    bias_ptr,  # [N] (HAS_BIAS)
    ws_ptr,  # fp32 [SPLIT_K, tiles, BLOCK_N, BLOCK_M]: one slot per share of each tile (SPLIT_K > 1)
    cnt_ptr,  # int32 [>= tiles]: arrival counters, zero between launches (SPLIT_K > 1)
    M,
    N,
    K,
    stride_sg,
    stride_zg,
    HAS_ZEROS: gl.constexpr,
    GROUP_TILES: gl.constexpr,  # K-tiles a group spans; 0: one group over all of K
    SCALES_AHEAD: gl.constexpr,  # tiles ahead the scales (and zeros) are loaded: 1 or 2
    HAS_BIAS: gl.constexpr,
    SPLIT_K: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``out = x @ dequant(W) + bias`` as ``(W^T x^T)^T``; grid ``(N tiles, M tiles, SPLIT_K)``."""
    dtype: gl.constexpr = x_desc.dtype
    WORDS: gl.constexpr = BLOCK_K // 2  # int32 words of one K-tile per storage row (4 weight rows)
    MMA_LAYOUT: gl.constexpr = _mma_layout(BLOCK_M, num_warps)
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_LAYOUT, k_width=2)
    WORD_LAYOUT: gl.constexpr = _word_layout(BLOCK_N, BLOCK_K, num_warps)

    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    pid_k = gl.program_id(2)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M
    num_k_tiles = gl.cdiv(K, BLOCK_K)
    per = gl.cdiv(num_k_tiles, SPLIT_K)
    kt0 = pid_k * per
    kt1 = gl.minimum(kt0 + per, num_k_tiles)
    count = kt1 - kt0
    # Every share holds a K-tile (the wrapper's split guarantees it). Said to the compiler, the loop has
    # no zero-trip path, where the zeroed accumulator would reach the final wait by movs and ptxas
    # would serialize every wgmma (C7515 in its -v output).
    gl.assume(count > 0)

    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N // 4, WORDS], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ring = (x_desc, w_desc, x_smem, w_smem, bars, off_m, pid_n, kt0, count)
    acc = _main_loop(
        ring, scales_ptr, zeros_ptr, N, stride_sg, stride_zg,
        MMA_LAYOUT, A_LAYOUT, WORD_LAYOUT, HAS_ZEROS, GROUP_TILES, SCALES_AHEAD,
    )  # fmt: skip

    rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA_LAYOUT))  # [BLOCK_N] output columns
    if SPLIT_K == 1:
        _write_out(acc, out_desc, bias_ptr, rows, N, off_m, off_n, HAS_BIAS)
    else:
        # This share's fp32 partial goes to its own workspace slot, stored from the accumulator layout into a
        # tile-major slot whose fastest dimension is the accumulator's (x rows): each thread's pairs are 8
        # contiguous bytes and a warp's store fills whole 32-byte sectors (the atomic adds this replaced
        # went out 4 bytes at a time, N apart, into a zeroed [M, N] buffer: 1.3-7x slower than one share).
        tile = pid_m * gl.num_programs(0) + pid_n
        tiles = gl.num_programs(0) * gl.num_programs(1)
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA_LAYOUT))  # [BLOCK_N]
        c = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA_LAYOUT))  # [BLOCK_M]
        local = gl.expand_dims(r, 1) * BLOCK_M + gl.expand_dims(c, 0)  # [BLOCK_N, BLOCK_M] offsets in a slot
        slot_elems: gl.constexpr = BLOCK_N * BLOCK_M
        gl.store(ws_ptr + (pid_k * tiles + tile).to(gl.int64) * slot_elems + local, acc)
        # Every thread's partial is stored before the counter's gpu-scope release; the last share's acquire
        # (the same atomic) then sees every other share's (the split-K pattern of w4a16_mma_triton).
        _cta_barrier()
        arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last share of this tile: sum, write, leave the counter at zero
            # in share order, whichever share arrives last: the same bits from run to run (adding the others'
            # partials onto the last share's own made the fp32 order follow the arrival with 3 or more shares)
            total = gl.zeros_like(acc)
            for sk in gl.static_range(SPLIT_K):
                if sk == pid_k:
                    total += acc
                else:
                    total += gl.load(
                        ws_ptr + (sk * tiles + tile).to(gl.int64) * slot_elems + local, cache_modifier=".cg"
                    )
            acc = total
            _write_out(acc, out_desc, bias_ptr, rows, N, off_m, off_n, HAS_BIAS)
            gl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _write_out(acc, out_desc, bias_ptr, rows, N, off_m, off_n, HAS_BIAS: gl.constexpr):
    """The finished tile (fp32 ``[BLOCK_N, BLOCK_M]``) plus the bias, in the output dtype, out through shared
    memory by TMA (rows and columns past M / N are clipped by the copy)."""
    if HAS_BIAS:
        b = gl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(gl.float32)  # [BLOCK_N]
        acc = acc + gl.expand_dims(b, 1)
    dtype: gl.constexpr = out_desc.dtype
    c_smem = gl.allocate_shared_memory(dtype, [acc.shape[1], acc.shape[0]], out_desc.layout)
    c_smem.store(gl.permute(acc.to(dtype), (1, 0)))  # [BLOCK_M, BLOCK_N]
    fence_async_shared()
    tma.async_copy_shared_to_global(out_desc, [off_m, off_n], c_smem)
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def supports(weight: MmaQuantWeight, dtype: torch.dtype, block_k: int = 128) -> bool:
    """Whether the kernel serves this weight: 4-bit, the kwidth-2 layout, no act-order, every K-tile in
    one group, 16-byte-aligned rows of x and of the output (TMA)."""
    g, k, n = weight.group_size, weight.in_features, weight.out_features
    return (
        weight.bits == 4
        and weight.kwidth == 2
        and weight.perm is None
        and dtype in _GL_DTYPES
        and (g % block_k == 0 or g >= k)
        and k % 8 == 0
        and n % 8 == 0
    )


MIN_BLOCK_M = 16  # the narrowest x tile (wgmma's N): decode rows (bench candidates; the decode launch lost, RESULTS)


def fit(cfg: WgmmaConfig, m: int) -> WgmmaConfig:
    """Clamp a config to the problem: 16 weight rows per warp at least, the x tile no wider than M
    needs (at least ``MIN_BLOCK_M``)."""
    if cfg.scales_ahead not in (1, 2):
        raise ValueError(f"scales_ahead={cfg.scales_ahead}: the kernel loads scales 1 or 2 K-tiles ahead")
    block_m = max(MIN_BLOCK_M, min(cfg.block_m, triton.next_power_of_2(m)))
    warps = min(cfg.num_warps, cfg.block_n // 16)
    return dataclasses.replace(cfg, block_m=block_m, num_warps=warps)


SPLIT_ENV = "QSERVE_W4A16_GLUON_SPLIT"
PROGRAMS_PER_SM = 2  # the default launch's 110 KB of shared memory: two programs an SM
MAX_SPLIT = 4
MIN_SHARE_TILES = 8  # K-tiles a share keeps at least (fewer: the partials' traffic outweighs the fill)
PROGRAM_OVERHEAD_TILES = 16  # a program's fixed cost (pipeline fill, epilogue) in K-tiles: fitted below
SPLIT_GAIN = 0.1  # the modelled saving a split must reach
MAX_SPLIT_M_TILES = 4  # split only where the weight's counters cover the tiles (ops: cdiv(N, 64) * 4)


def split_setting() -> str:
    """``QSERVE_W4A16_GLUON_SPLIT``: "" (unset: ``auto_split``, the default), "auto" (the same), or a share
    count 1-8 (1: never split). Anything else is refused, naming the variable."""
    value = os.environ.get(SPLIT_ENV, "").strip()
    if value not in ("", "auto") and not (value.isdigit() and 1 <= int(value) <= 8):
        raise ValueError(f"{SPLIT_ENV}={value!r}: expected auto, a share count 1-8, or unset")
    return value


def auto_split(m: int, k: int, n: int, sms: int, cfg: WgmmaConfig) -> int:
    """K shares for one product, from a model of the launch: waves of programs over the SMs' program slots,
    times what a program costs: its K-tiles, a fixed ``PROGRAM_OVERHEAD_TILES``, and one K-tile's worth for
    a share's partial. The cheapest count of 1-``MAX_SPLIT`` wins where it saves ``SPLIT_GAIN``. The overhead
    is fitted to the H100's timings of 1-4 shares at 128-512 rows of the four Qwen2.5-14B layers
    (bench/RESULTS.md, twenty-first session): it picks the measured best or one within 1% at every one but
    qkv at 128 rows (2 shares, 4% ahead of 1). On 132 SMs: at 128 rows o and down 3, qkv 2, gate_up 1; at
    256 and 512 rows down 3, the others 1. No split past ``MAX_SPLIT_M_TILES`` row tiles (the counters) or
    under ``MIN_SHARE_TILES`` K-tiles a share."""
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    k_tiles = triton.cdiv(k, cfg.block_k)
    if triton.cdiv(m, cfg.block_m) > MAX_SPLIT_M_TILES:
        return 1
    slots = max(1, sms * PROGRAMS_PER_SM)

    def cost(split: int) -> int:
        per_program = triton.cdiv(k_tiles, split) + PROGRAM_OVERHEAD_TILES + (split > 1)
        return triton.cdiv(tiles * split, slots) * per_program

    best = 1
    for split in range(2, MAX_SPLIT + 1):
        if triton.cdiv(k_tiles, split) < MIN_SHARE_TILES:
            break
        if cost(split) < cost(best):
            best = split
    return best if cost(best) <= (1 - SPLIT_GAIN) * cost(1) else 1


NARROW_BLOCK_M = 64  # x tiles this narrow or narrower (33-64 rows: the narrow launch) get NARROW_STAGES
NARROW_STAGES = 4  # 80 KB of shared memory at 64 x 64 tiles: still two programs an SM


TILE_ENV = "QSERVE_W4A16_GLUON_TILE"


def tile_setting() -> WgmmaConfig | None:
    """``QSERVE_W4A16_GLUON_TILE`` (a measurement switch, unset by default): ``block_m x block_n x block_k x
    stages x warps`` (e.g. ``64x128x64x4x4``: 128 weight rows a program, half the x reads from L2) for the
    launch at 65+ rows in place of ``WgmmaConfig()``'s; unset or empty: the built-in tiles. A value the kernel
    cannot compile (block_k 64 or 128, block_n a multiple of 16 per warp, 1 or 2 warpgroups) is refused,
    naming the variable."""
    value = os.environ.get(TILE_ENV, "").strip()
    if not value:
        return None
    fields = value.split("x")
    if len(fields) != 5 or not all(f.isdigit() for f in fields):
        raise ValueError(f"{TILE_ENV}={value!r}: expected block_m x block_n x block_k x stages x warps")
    bm, bn, bk, stages, warps = (int(f) for f in fields)
    if (
        bm not in (16, 32, 64, 128, 256)
        or bk not in (64, 128)
        or warps not in (4, 8)
        or bn % (16 * warps) != 0
        or not 2 <= stages <= 8
    ):
        raise ValueError(
            f"{TILE_ENV}={value!r}: block_m 16-256 (a power of two), block_k 64 or 128, 4 or 8 warps with "
            "block_n a multiple of 16 a warp, 2-8 stages"
        )
    return WgmmaConfig(block_m=bm, block_n=bn, block_k=bk, stages=stages, num_warps=warps)


def default_config(m: int, k: int, n: int, sms: int) -> WgmmaConfig:
    """The launch ``w4a16_mma_triton`` hands this kernel: ``WgmmaConfig()`` fitted to ``m`` rows (x tiles of
    64 rows or fewer in ``NARROW_STAGES``: the 64-row launch that beat the Triton table for qkv, o and down
    on the H100, twenty-first and twenty-second sessions; past 64 rows ``tile_setting``'s tiles where set),
    in the shares ``split_setting`` names (unset: ``auto_split``)."""
    cfg = fit(WgmmaConfig(), m)
    tiles = tile_setting() if m > NARROW_BLOCK_M else None
    if tiles is not None:
        cfg = fit(tiles, m)
    elif cfg.block_m <= NARROW_BLOCK_M:
        cfg = dataclasses.replace(cfg, stages=NARROW_STAGES)
    setting = split_setting()
    if setting in ("", "auto"):
        return dataclasses.replace(cfg, split_k=auto_split(m, k, n, sms, cfg))
    if triton.cdiv(m, cfg.block_m) <= MAX_SPLIT_M_TILES:  # a forced count, where the counters cover it
        return dataclasses.replace(cfg, split_k=int(setting))
    return cfg


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can address ``t`` (2-D, unit inner stride, 16-byte-aligned start and rows)."""
    size = t.element_size()
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * size) % 16 == 0


def group_tiles(group_size: int, k: int, block_k: int) -> int:
    """The kernel's ``GROUP_TILES``: K-tiles per quantization group, 0 where one group spans all of K
    (``supports`` guarantees one of the two)."""
    if group_size >= k:
        return 0
    return group_size // block_k


def effective_split(k_tiles: int, split_k: int) -> int:
    """Shares of ``cdiv(k_tiles, split_k)`` K-tiles each that cover ``k_tiles`` with none empty (the kernel
    assumes every share holds a tile)."""
    per = triton.cdiv(k_tiles, max(1, split_k))
    return triton.cdiv(k_tiles, per)


def w4a16_wgmma(
    x: torch.Tensor,  # [M, K] fp16 / bf16
    weight: MmaQuantWeight,
    bias: torch.Tensor | None = None,  # [N]
    config: WgmmaConfig | None = None,
    out: torch.Tensor | None = None,  # [M, N]
    counters: torch.Tensor | None = None,  # int32 [>= tiles], zeros, reused across calls (split-K only)
) -> torch.Tensor:
    """``x @ dequant(weight) + bias`` on an sm90 device; ``[M, N]``. A split-K launch needs one zeroed
    arrival counter per output tile (``counters``: the weight's, ``quant_kernels.ops``; each launch leaves
    them at zero again) and allocates its fp32 workspace per call (graph-safe through the caching
    allocator, as ``w4a16_mma_triton``'s)."""
    m, k = x.shape
    n = weight.out_features
    cfg = fit(config or WgmmaConfig(), m)
    if k != weight.in_features:
        raise ValueError(f"x has K={k}, weight has in_features={weight.in_features}")
    if not supports(weight, x.dtype, cfg.block_k):
        raise ValueError(
            f"w4a16_wgmma serves 4-bit, kwidth-2, no act-order weights with group size a multiple of "
            f"{cfg.block_k} and K, N multiples of 8 in fp16/bf16; got bits={weight.bits}, kwidth={weight.kwidth}, "
            f"act-order={weight.perm is not None}, group_size={weight.group_size}, K={k}, N={n}, {x.dtype}"
        )
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return out
    if not _tma_ok(out):  # a view TMA cannot address (a misaligned start or row): write a fresh tile, copy
        out.copy_(w4a16_wgmma(x, weight, bias, config, counters=counters))
        return out
    x = x.contiguous()
    if not _tma_ok(x):
        x = x.clone()
    gdt = _GL_DTYPES[x.dtype]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt))
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    zeros = weight.zeros if weight.zeros is not None else weight.scales
    w_desc = TensorDescriptor.from_tensor(weight.qweight, [bn // 4, bk // 2], w_layout)
    out_desc = TensorDescriptor.from_tensor(out, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], gdt))
    split = effective_split(triton.cdiv(k, bk), cfg.split_k)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    tiles = grid[0] * grid[1]
    if split > 1:
        ws = torch.empty((split, tiles, bn, bm), dtype=torch.float32, device=x.device)  # one slot a share
        if counters is None:
            counters = torch.zeros(tiles, dtype=torch.int32, device=x.device)
        elif counters.dtype != torch.int32 or counters.numel() < tiles:
            raise ValueError(
                f"split-K over {tiles} output tiles needs int32 counters of >= {tiles} entries, got "
                f"{counters.dtype} [{counters.numel()}]"
            )
    else:
        ws = kdevice.placeholder(x.device, torch.float32)
        counters = kdevice.placeholder(x.device, torch.int32)
    w4a16_wgmma_kernel[grid](
        x_desc,
        w_desc,
        out_desc,
        weight.scales,
        zeros,
        bias if bias is not None else weight.scales,
        ws,
        counters,
        m,
        n,
        k,
        weight.scales.stride(0),
        zeros.stride(0),
        HAS_ZEROS=weight.zeros is not None,
        GROUP_TILES=group_tiles(weight.group_size, k, bk),
        SCALES_AHEAD=cfg.scales_ahead,
        HAS_BIAS=bias is not None,
        SPLIT_K=split,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=cfg.stages,
        num_warps=cfg.num_warps,
    )
    return out


def _desc_type(dtype: str, block: list[int], layout: gl.NVMMASharedLayout) -> str:
    """The JIT's signature string of a Gluon TMA descriptor argument."""
    return f"tensordesc<{dtype}[{', '.join(map(str, block))}],{layout!r}>"


def compile_for(
    arch: int,
    cfg: WgmmaConfig,
    dtype: str = "fp16",
    asym: bool = False,
    bias: bool = False,
    m: int = 4096,
    group_size: int = 128,
    k: int = 5120,
):
    """The compiled ``w4a16_wgmma_kernel`` for ``sm_<arch>`` without a GPU (``triton.compile`` with a
    ``GPUTarget``), with the argument types and constexprs ``w4a16_wgmma`` launches with (a weight of
    this group size and K)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    cfg = fit(cfg, m)
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    signature = {
        "x_desc": _desc_type(dtype, [bm, bk], gl.NVMMASharedLayout.get_default_for([bm, bk], gdt)),
        "w_desc": _desc_type("i32", [bn // 4, bk // 2], w_layout),
        "out_desc": _desc_type(dtype, [bm, bn], gl.NVMMASharedLayout.get_default_for([bm, bn], gdt)),
        "scales_ptr": "*fp16",
        "zeros_ptr": "*fp16",
        "bias_ptr": f"*{dtype}" if bias else "*fp16",
        "ws_ptr": "*fp32",
        "cnt_ptr": "*i32",
        "M": "i32",
        "N": "i32",
        "K": "i32",
        "stride_sg": "i32",
        "stride_zg": "i32",
    }
    constants = dict(
        HAS_ZEROS=asym,
        GROUP_TILES=group_tiles(group_size, k, cfg.block_k),
        SCALES_AHEAD=cfg.scales_ahead,
        HAS_BIAS=bias,
        SPLIT_K=effective_split(triton.cdiv(k, cfg.block_k), cfg.split_k),  # as the launch's
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=cfg.stages,
        num_warps=cfg.num_warps,
    )
    for name in constants:
        signature[name] = "constexpr"
    fn = w4a16_wgmma_kernel
    aligned = [(i,) for i, name in enumerate(fn.arg_names) if signature[name].startswith("*") or name in ("N", "K")]
    attrs = {path: [["tt.divisibility", 16]] for path in aligned}
    return triton.compile(
        GluonASTSource(fn, signature, constants, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=cfg.num_warps),
    )
