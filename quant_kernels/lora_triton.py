"""Triton kernels for multi-LoRA, Punica style: a grouped shrink (``h = x @ A^T``) and a grouped
expand (``y += h @ B^T``) over the token rows of a step, each row with its own adapter slot.

Knows: the layout and numerics of ``quant_kernels.reference_lora``, the row grouping of
``quant_kernels.lora_ops.LoRAIndices`` and how to split the shrink's K over enough programs to fill a
GPU (``shrink_config``), and for the fused gate_up kernel the SiLU-and-mul's numerics
(``elementwise_triton.silu_mul`` in fp32, rounded once, in its ``SILU_BLOCK``-column row blocks). Must not know: models, layers, PEFT files, engines. Imported lazily (by
``quant_kernels.lora_ops`` on CUDA unless ``QSERVE_LORA_TRITON=0``, or by tests under
``TRITON_INTERPRET=1``).

Grouping: the rows of a step that use an adapter are sorted by slot (``sorted_rows``) and cut into
tiles of at most ``TILE_ROWS`` rows of ONE slot (``tile_offsets`` / ``tile_lens`` / ``tile_slots``);
a tile of length 0 is padding (a CUDA graph's fixed tile count) and does nothing.
A tile of a prefill segment is up to 16 consecutive tokens of one sequence; in a decode step the
rows of every sequence on the same adapter share tiles, so an adapter's A and B are read once per
16 rows, not once per row (the point of Punica's grouped GEMMs). Rows of the base model are in no
tile: the shrink and the expand never touch them (the fused SiLU kernel writes their product, from y
alone).

Kernels
-------
``lora_shrink_kernel``: grid ``(num_tiles, S, split_k)``: the tile's ``[TILE_ROWS, K]`` rows of ``x``
  (gathered through ``sorted_rows``) times slice ``s``'s ``[R, K]`` block of ``A`` of the tile's slot,
  over one ``k_per_split`` stretch of K in ``BLOCK_K`` steps, fp32 accumulator. With one split the
  result is stored rounded to the activation dtype at ``h[row, s*R:]``. With several (split-K), each
  program stores its fp32 partial in a workspace ``[split_k, T, S*R]`` and bumps the tile-slice's
  arrival counter; the last to arrive sums the partials in a fixed order (one ``tl.sum`` over the
  split axis: deterministic, whatever the arrival order), stores ``h`` rounded once, and sets the
  counter back to 0. So ``h`` is rounded at the same point as the reference's, no memset is needed
  (the workspace rows the reduction reads are all written by the same launch; counters are zero
  before and after every launch), and there are two launches per layer, not three.
``lora_expand_kernel``: grid ``(num_tiles, sum_s ceil(N_s / BLOCK_N))``: the output blocks of all
  slices laid end to end (a narrow k/v slice takes only its own blocks, no masked-out programs);
  the tile's ``[TILE_ROWS, R]`` of ``h`` times ``BLOCK_N`` rows of slice ``s`` of ``B``, added in fp32
  to the base output ``y`` (read, add, one rounding, write back: each row lives in one tile, so no
  two programs write it). ``BLOCK_N`` is 64, 128 or 256, as the caller asks (``lora_ops``'
  ``QSERVE_LORA_EXPAND_BLOCK_N``; its default "auto" is ``expand_block_n``'s rule: 256 where a
  64-column grid of a decode graph's padded tiles would pass ``WIDE_EXPAND_PROGRAMS`` programs).
  With ``QSERVE_ENABLE_PDL=1`` (``quant_kernels.pdl``) it launches with PDL and waits at its top for the
  base GEMM it adds to, so its launch overlaps that GEMM's tail (a decode step's expands are on its
  critical path).
``lora_expand_silu_mul_kernel`` (``QSERVE_LORA_FUSED_SILU=1``, opt-in: ``lora_ops``): a gate_up layer's
  expand fused into the SiLU-and-mul that reads its output: one 1-D grid of every base row's column
  blocks (plain ``silu(gate) * up``), then every tile's ``BLOCK_N``-column blocks, each adding the tile's
  ``h @ B`` to gate's and up's columns, rounding to the activation dtype as the expand does, then
  multiplying. A decode step's gate_up then launches one kernel after its GEMM, not two, and
  ``y + B(h)`` is never written back and read again.

Why split-K: at decode a step has a handful of tiles, and a shrink program that walks all of K
(5120 or 13824) alone is a serial chain of loads on one SM: 35-105 µs a layer on the H200 whatever
the batch, for microseconds of bytes. Splitting K puts the same bytes in flight on many SMs.

None allocates, synchronises with the host or launches a grid not fixed by host integers (the caller
allocates ``h``, the workspace and the fused kernel's output; the counters come with the step's
indices). The fused kernel's row count is not specialised on (``do_not_specialize``): it changes with
every eager step, and a count of 1 or a multiple of 16 would otherwise compile another variant mid-serving.

Fusing the pair into one launch would need every K split of a tile-slice done before any of its N
blocks starts: a grid-wide dependency (a spin-wait on programs that may not be resident, or the last
shrink program walking all of N alone, the serial chain again). Left as two launches.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quant_kernels.elementwise_triton import SILU_BLOCK, silu_mul
from quant_kernels.pdl import launch_options

TILE_ROWS = 16  # rows per tile (the MMA's smallest M); lora_ops builds tiles of this size
MAX_SLICES = 3  # = lora_ops.MAX_SLICES: a fused qkv; arrival counters per tile
EXPAND_BLOCK_N = 64  # the expand's narrowest output block (expand_block_n's choice below the wide grids)
EXPAND_BLOCK_NS = (64, 128, 256)
# expand_block_n's rule: past this many programs in a 64-column grid, 256-column blocks. A decode graph at
# batch 32 with 32 slots pads to 34 tiles: gate_up's 34 x 432 programs took 18.6 µs with 64-column
# blocks, 14.2 with 256 (H100, bench/lora.py), while qkv (34 x 112), o and down were even and batch 1
# (2 tiles) 0.2-1.0 µs slower with 256.
WIDE_EXPAND_PROGRAMS = 8192
# shrink_config's knobs (see there).
SHRINK_BLOCK_K = 128
PROGRAMS_PER_SM = 4
MAX_PROGRAMS_PER_SM = 16
MIN_SPLIT_BLOCKS = 2
MAX_SPLIT_K = 32
# Under TRITON_INTERPRET=1 (CPU tests) bf16 tl.dot gives garbage in Triton 3.6's interpreter (as
# attention_triton notes): the dots run in fp32 there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True, slots=True)
class ShrinkConfig:
    """How the shrink walks K: ``split_k`` programs per tile-slice, each over ``k_per_split``
    columns (a multiple of ``block_k``) in ``block_k`` steps."""

    split_k: int
    block_k: int
    k_per_split: int


@functools.lru_cache(maxsize=1024)
def shrink_config(
    k: int,
    num_rows: int,
    num_tiles: int,
    num_slices: int,
    num_sms: int,
    split_k: int | None = None,
    block_k: int | None = None,
) -> ShrinkConfig:
    """The shrink's K split for a launch of ``num_tiles`` tiles (padding included) over ``num_rows``
    rows of width ``k``, with ``num_slices`` slices, on a GPU of ``num_sms`` SMs.

    Heuristic. A tile-slice certainly busy is one of ``min(num_tiles, ceil(num_rows / 16))`` (a
    CUDA graph's tile count is padded for the most adapters; its rows are known): give those
    ``PROGRAMS_PER_SM * num_sms`` programs between them, so that decode (1-10 tiles) fills the card
    (one program per SM keeps too few loads in flight; four do, in ~24 KB of shared memory each).
    Bounds: each split covers at least ``MIN_SPLIT_BLOCKS`` K blocks (the arrival counter and the
    partial cost about one block's load: shorter splits would be mostly overhead); at most
    ``MAX_SPLIT_K`` splits (the reduction holds ``[MAX_SPLIT_K, 16, R]`` fp32 in registers); and all
    tiles together launch at most ``MAX_PROGRAMS_PER_SM * num_sms`` programs (one wave of 4-warp
    programs), so a long prefill is split little or not at all. Its choices for the shapes measured on
    the H200 (132 SMs, Qwen2.5-14B, rank 16): decode at batch 1-128 with 1-32 adapters splits K=5120 in 20 (256
    columns each) and K=13824 in 27 (512), eager or graphed (qkv in a batch-128 graph with 32 slots:
    14); a 2048-row prefill over 4 adapters splits in 2 (qkv) to 5 (o, down).
    ``split_k`` / ``block_k``: overrides for tuning (``bench/lora.py --split-k``); the split is then
    rounded to what whole ``block_k`` steps allow.
    """
    if block_k is None:
        block_k = SHRINK_BLOCK_K if k >= 8 * SHRINK_BLOCK_K else 64
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"lora shrink: block_k must be a power of two >= 16, got {block_k}")
    k_blocks = triton.cdiv(k, block_k)
    if split_k is None:
        busy = min(num_tiles, triton.cdiv(num_rows, TILE_ROWS)) * num_slices
        split_k = triton.cdiv(PROGRAMS_PER_SM * num_sms, max(busy, 1))
        split_k = min(split_k, k_blocks // MIN_SPLIT_BLOCKS, MAX_SPLIT_K)
        split_k = min(split_k, MAX_PROGRAMS_PER_SM * num_sms // max(num_tiles * num_slices, 1))
    elif not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"lora shrink: split_k must be 1..{MAX_SPLIT_K}, got {split_k}")
    split_k = max(1, min(split_k, k_blocks))
    blocks_per_split = triton.cdiv(k_blocks, split_k)
    return ShrinkConfig(triton.cdiv(k_blocks, blocks_per_split), block_k, blocks_per_split * block_k)


@triton.jit
def _tile_rows(ROWS, TILE_OFF, TILE_SLOT, tile, count, BLOCK_M: tl.constexpr):
    """``(slot, rows [BLOCK_M] int64, row_mask [BLOCK_M])`` of a non-empty tile: its adapter slot and
    the token rows it covers (``count`` of them; masked rows read row 0)."""
    first = tl.load(TILE_OFF + tile)
    slot = tl.load(TILE_SLOT + tile).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    row_mask = m < count
    rows = tl.load(ROWS + first + m, mask=row_mask, other=0).to(tl.int64)
    return slot, rows, row_mask


@triton.jit
def lora_shrink_kernel(
    X,  # [T, K]
    A,  # [L, S * R, K]
    OUT,  # [T, S * R], X's dtype
    WS,  # fp32 [split_k, T, S * R] workspace (a never-read placeholder with one split)
    CNT,  # int32 [>= num_tiles * S] arrival counters, zero (unused with one split)
    ROWS,  # int32 [T_lora]
    TILE_OFF,  # int32 [G]
    TILE_LEN,  # int32 [G]
    TILE_SLOT,  # int32 [G]
    K,
    k_per_split,
    split_k,
    stride_xm,
    stride_al,
    stride_ar,
    stride_om,
    stride_wsk,
    stride_wsm,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_PAD: tl.constexpr,  # next power of two >= split_k; 1: no split (the atomics never compile)
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    split = tl.program_id(2)
    count = tl.load(TILE_LEN + tile)
    if count > 0:  # an empty tile (a CUDA graph's padding) reads nothing and takes no counter
        slot, rows, row_mask = _tile_rows(ROWS, TILE_OFF, TILE_SLOT, tile, count, BLOCK_M)
        r = tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        a_rows = (s * RANK + r).to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_lo = split * k_per_split
        k_hi = tl.minimum(K, k_lo + k_per_split)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < K  # k_per_split is a multiple of BLOCK_K: only the last split has a tail
            x = tl.load(
                X + rows[:, None] * stride_xm + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )  # [BLOCK_M, BLOCK_K]
            a = tl.load(
                A + slot * stride_al + a_rows[None, :] * stride_ar + k[:, None],
                mask=r_mask[None, :] & k_mask[:, None],
                other=0.0,
            )  # [BLOCK_K, BLOCK_R]
            if DOT_F32:
                acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
            else:
                acc += tl.dot(x, a)
        cols = s * RANK + r
        mask = row_mask[:, None] & r_mask[None, :]
        out = OUT + rows[:, None] * stride_om + cols[None, :]
        if SPLIT_PAD == 1:
            tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)
        else:
            ws = WS + rows[:, None] * stride_wsm + cols[None, :]  # [BLOCK_M, BLOCK_R]
            tl.store(ws + split * stride_wsk, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the release below
            counter = CNT + tile * tl.num_programs(1) + s
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:  # the last split of this tile-slice: reduce, round once, reset
                sk = tl.arange(0, SPLIT_PAD)
                parts = tl.load(
                    ws[None, :, :] + sk[:, None, None] * stride_wsk,
                    mask=(sk < split_k)[:, None, None] & mask[None, :, :],
                    other=0.0,
                    cache_modifier=".cg",  # written by other SMs: past this SM's L1
                )  # [SPLIT_PAD, BLOCK_M, BLOCK_R]
                tl.store(out, tl.sum(parts, axis=0).to(OUT.dtype.element_ty), mask=mask)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def lora_expand_kernel(
    Y,  # [T, N], updated in place
    H,  # [T, S * R]
    B,  # [L, N, R]
    ROWS,  # int32 [T_lora]
    TILE_OFF,  # int32 [G]
    TILE_LEN,  # int32 [G]
    TILE_SLOT,  # int32 [G]
    n_bound0,
    n_bound1,
    n_bound2,
    n_bound3,
    first_block1,  # the first output block of slice 1 (past the grid when there is none)
    first_block2,  # likewise slice 2
    stride_ym,
    stride_hm,
    stride_bl,
    stride_bn,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (quant_kernels.pdl): wait for the kernel before first
):
    if USE_PDL:  # y is the GEMM's output, launched right before: nothing is touched before it ends
        gdc_wait()
        gdc_launch_dependents()
    tile = tl.program_id(0)
    block = tl.program_id(1)
    count = tl.load(TILE_LEN + tile)
    if count > 0:  # an empty tile (padding) does nothing
        s = (block >= first_block1).to(tl.int32) + (block >= first_block2).to(tl.int32)
        block_lo = tl.where(s == 0, 0, tl.where(s == 1, first_block1, first_block2))
        n_lo = tl.where(s == 0, n_bound0, tl.where(s == 1, n_bound1, n_bound2))
        n_hi = tl.where(s == 0, n_bound1, tl.where(s == 1, n_bound2, n_bound3))
        slot, rows, row_mask = _tile_rows(ROWS, TILE_OFF, TILE_SLOT, tile, count, BLOCK_M)
        r = tl.arange(0, BLOCK_R)
        r_mask = r < RANK
        n = (n_lo + (block - block_lo) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        n_mask = n < n_hi
        h = tl.load(
            H + rows[:, None] * stride_hm + (s * RANK + r)[None, :],
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        b = tl.load(
            B + slot * stride_bl + n[None, :] * stride_bn + r[:, None],
            mask=r_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_R, BLOCK_N]
        if DOT_F32:
            acc = tl.dot(h.to(tl.float32), b.to(tl.float32))  # [BLOCK_M, BLOCK_N]
        else:
            acc = tl.dot(h.to(b.dtype), b)  # [BLOCK_M, BLOCK_N] fp32
        mask = row_mask[:, None] & n_mask[None, :]
        y_ptr = Y + rows[:, None] * stride_ym + n[None, :]
        y = tl.load(y_ptr, mask=mask, other=0.0)
        tl.store(y_ptr, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def lora_expand_silu_mul_kernel(
    Y,  # [T, 2I]: a gate_up layer's base output (read only)
    OUT,  # [T, I]: silu(gate) * up, Y's dtype
    H,  # [T, 2R]: the shrink's output (gate's R columns, then up's)
    B,  # [L, 2I, R]
    SLOTS,  # int32 [T], -1: a base row
    ROWS,  # int32 [T_lora]
    TILE_OFF,  # int32 [G]
    TILE_LEN,  # int32 [G]
    TILE_SLOT,  # int32 [G]
    num_rows,  # T
    n_cols,  # I
    row_blocks,  # cdiv(I, ROW_BLOCK): a base row's programs
    tile_blocks,  # cdiv(I, BLOCK_N): a tile's programs
    stride_ym,
    stride_om,
    stride_hm,
    stride_bl,
    stride_bn,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (quant_kernels.pdl): wait for the kernel before first
):
    if USE_PDL:  # Y is the GEMM's output, launched right before: nothing is touched before it ends
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    row_programs = num_rows * row_blocks
    if pid < row_programs:  # a base row's column block (a row with a slot is its tile's: nothing here)
        row = pid // row_blocks
        if tl.load(SLOTS + row) < 0:
            row64 = row.to(tl.int64)
            cols = (pid % row_blocks) * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
            mask = cols < n_cols
            gate = tl.load(Y + row64 * stride_ym + cols, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(Y + row64 * stride_ym + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(OUT + row64 * stride_om + cols, silu_mul(gate, up).to(OUT.dtype.element_ty), mask=mask)
    else:  # a tile's column block: gate and up columns n get their adapter's expand, then the product
        tile = (pid - row_programs) // tile_blocks
        block = (pid - row_programs) % tile_blocks
        count = tl.load(TILE_LEN + tile)
        if count > 0:  # an empty tile (padding) does nothing
            slot, rows, row_mask = _tile_rows(ROWS, TILE_OFF, TILE_SLOT, tile, count, BLOCK_M)
            r = tl.arange(0, BLOCK_R)
            r_mask = r < RANK
            n = (block * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
            n_mask = n < n_cols
            h_mask = row_mask[:, None] & r_mask[None, :]
            h_gate = tl.load(H + rows[:, None] * stride_hm + r[None, :], mask=h_mask, other=0.0)  # [BLOCK_M, BLOCK_R]
            h_up = tl.load(H + rows[:, None] * stride_hm + (RANK + r)[None, :], mask=h_mask, other=0.0)
            b_ptr = B + slot * stride_bl + n[None, :] * stride_bn + r[:, None]  # [BLOCK_R, BLOCK_N]: gate's rows
            b_mask = r_mask[:, None] & n_mask[None, :]
            b_gate = tl.load(b_ptr, mask=b_mask, other=0.0)
            b_up = tl.load(b_ptr + n_cols * stride_bn, mask=b_mask, other=0.0)  # up's rows, I further
            if DOT_F32:
                acc_gate = tl.dot(h_gate.to(tl.float32), b_gate.to(tl.float32))  # [BLOCK_M, BLOCK_N]
                acc_up = tl.dot(h_up.to(tl.float32), b_up.to(tl.float32))
            else:
                acc_gate = tl.dot(h_gate.to(b_gate.dtype), b_gate)  # [BLOCK_M, BLOCK_N] fp32
                acc_up = tl.dot(h_up.to(b_up.dtype), b_up)
            mask = row_mask[:, None] & n_mask[None, :]
            y_ptr = Y + rows[:, None] * stride_ym + n[None, :]
            # y + B(h) rounded to the activation dtype, as lora_expand_kernel leaves it for silu_and_mul
            gate = (tl.load(y_ptr, mask=mask, other=0.0).to(tl.float32) + acc_gate).to(Y.dtype.element_ty)
            up = (tl.load(y_ptr + n_cols, mask=mask, other=0.0).to(tl.float32) + acc_up).to(Y.dtype.element_ty)
            gate = gate.to(tl.float32)
            out = silu_mul(gate, up.to(tl.float32))
            tl.store(OUT + rows[:, None] * stride_om + n[None, :], out.to(OUT.dtype.element_ty), mask=mask)


# The per-launch host arithmetic below is plain Python, cached per shape: ``triton.cdiv`` and
# ``triton.next_power_of_2`` are constexpr functions, ~2-3 µs a call from host code (issue 30: an
# eager step makes ~190 LoRA calls).
def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


@functools.lru_cache(maxsize=64)
def _block_r(rank: int) -> int:
    return max(16, _next_power_of_2(rank))


@functools.lru_cache(maxsize=256)
def expand_block_n(num_tiles: int, slice_starts: tuple[int, ...]) -> int:
    """The N block of an expand of ``num_tiles`` tiles (padding included) over ``slice_starts``: 256 where
    64-column blocks would launch more than ``WIDE_EXPAND_PROGRAMS`` programs, else 64 (the rule behind
    ``QSERVE_LORA_EXPAND_BLOCK_N=auto``; see ``WIDE_EXPAND_PROGRAMS`` for what it was fitted to)."""
    programs = num_tiles * expand_geometry(slice_starts, EXPAND_BLOCK_N)[1]
    return 256 if programs > WIDE_EXPAND_PROGRAMS else EXPAND_BLOCK_N


@functools.lru_cache(maxsize=256)
def expand_geometry(
    slice_starts: tuple[int, ...], block_n: int = EXPAND_BLOCK_N
) -> tuple[tuple[int, ...], int, int, int]:
    """``(bounds, total, first1, first2)`` of an expand over the output slices ``slice_starts`` in
    ``block_n``-column blocks: the 4 slice bounds the kernel takes (missing slices empty at the end), the
    N blocks of all slices together (the grid's second axis), and where slices 1 and 2 start among them
    (past the grid for a slice that does not exist)."""
    num_slices = len(slice_starts) - 1
    if not 1 <= num_slices <= MAX_SLICES:
        raise ValueError(f"lora_expand: 1 to {MAX_SLICES} output slices, got {num_slices}")
    if block_n not in EXPAND_BLOCK_NS:
        raise ValueError(f"lora_expand: block_n must be one of {EXPAND_BLOCK_NS}, got {block_n}")
    bounds = tuple(slice_starts) + (slice_starts[-1],) * (4 - len(slice_starts))
    blocks = [-(-(slice_starts[i + 1] - slice_starts[i]) // block_n) for i in range(num_slices)]
    total = sum(blocks)
    first1 = blocks[0] if num_slices > 1 else total
    first2 = blocks[0] + blocks[1] if num_slices > 2 else total
    return bounds, total, first1, first2


def lora_shrink(
    x: torch.Tensor,  # [T, K], last dim contiguous
    lora_a: torch.Tensor,  # [L, S * R, K], last dim contiguous
    sorted_rows: torch.Tensor,  # int32 [T_lora]
    tile_offsets: torch.Tensor,  # int32 [G]
    tile_lens: torch.Tensor,  # int32 [G]
    tile_slots: torch.Tensor,  # int32 [G]
    num_slices: int,
    out: torch.Tensor,  # [T, S * R], x's dtype, last dim contiguous
    config: ShrinkConfig,
    workspace: torch.Tensor,  # fp32 [>= config.split_k, T, S * R] contiguous; any fp32 tensor with one split
    counters: torch.Tensor,  # int32 [>= G * S], zero; left zero (unused with one split)
) -> torch.Tensor:
    """``out[row] = x[row] @ A[slot]^T`` for the rows of every tile (see the module doc)."""
    num_tiles = tile_offsets.shape[0]
    if num_tiles == 0:
        return out
    rank = lora_a.shape[1] // num_slices
    split = config.split_k > 1
    if split and (
        workspace.dtype != torch.float32
        or tuple(workspace.shape[1:]) != tuple(out.shape)
        or workspace.shape[0] < config.split_k
        or not workspace.is_contiguous()
    ):
        raise ValueError(
            f"lora_shrink: workspace must be contiguous fp32 [>= {config.split_k}, {out.shape[0]}, {out.shape[1]}], "
            f"got {workspace.dtype} {tuple(workspace.shape)}"
        )
    if split and (counters.dtype != torch.int32 or counters.numel() < num_tiles * num_slices):
        raise ValueError(
            f"lora_shrink: counters must be int32 with >= {num_tiles * num_slices} entries, "
            f"got {counters.dtype} with {counters.numel()}"
        )
    lora_shrink_kernel[(num_tiles, num_slices, config.split_k)](
        x,
        lora_a,
        out,
        workspace,
        counters,
        sorted_rows,
        tile_offsets,
        tile_lens,
        tile_slots,
        x.shape[1],
        config.k_per_split,
        config.split_k,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        out.stride(0),
        workspace.stride(0) if split else 0,
        workspace.stride(1) if split else 0,
        RANK=rank,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=_block_r(rank),
        BLOCK_K=config.block_k,
        SPLIT_PAD=_next_power_of_2(config.split_k),
        DOT_F32=_INTERPRET,
        num_warps=4,
    )
    return out


def lora_expand(
    y: torch.Tensor,  # [T, N], updated in place, last dim contiguous
    h: torch.Tensor,  # [T, S * R], last dim contiguous
    lora_b: torch.Tensor,  # [L, N, R], last dim contiguous
    sorted_rows: torch.Tensor,  # int32 [T_lora]
    tile_offsets: torch.Tensor,  # int32 [G]
    tile_lens: torch.Tensor,  # int32 [G]
    tile_slots: torch.Tensor,  # int32 [G]
    slice_starts: Sequence[int],  # S + 1 bounds along N, S <= 3
    block_n: int = EXPAND_BLOCK_N,  # one of EXPAND_BLOCK_NS (lora_ops chooses; expand_block_n's rule)
) -> torch.Tensor:
    """``y[row, slice s] += h[row, s*R:(s+1)*R] @ B[slot, slice s]^T`` for the rows of every tile."""
    num_tiles = tile_offsets.shape[0]
    if num_tiles == 0:
        return y
    bounds, total, first1, first2 = expand_geometry(tuple(slice_starts), block_n)
    rank = lora_b.shape[2]
    lora_expand_kernel[(num_tiles, total)](
        y,
        h,
        lora_b,
        sorted_rows,
        tile_offsets,
        tile_lens,
        tile_slots,
        *bounds,
        first1,
        first2,
        y.stride(0),
        h.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        RANK=rank,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=_block_r(rank),
        BLOCK_N=block_n,
        DOT_F32=_INTERPRET,
        num_warps=4,
        **launch_options(y.device),
    )
    return y


def lora_expand_silu_and_mul(
    y: torch.Tensor,  # [T, 2I]: a gate_up layer's base output, last dim contiguous (read only)
    h: torch.Tensor,  # [T, 2R], last dim contiguous
    lora_b: torch.Tensor,  # [L, 2I, R], last dim contiguous
    token_slots: torch.Tensor,  # int32 [T], -1: base row
    sorted_rows: torch.Tensor,  # int32 [T_lora]
    tile_offsets: torch.Tensor,  # int32 [G]
    tile_lens: torch.Tensor,  # int32 [G]
    tile_slots: torch.Tensor,  # int32 [G]
    out: torch.Tensor,  # [T, I], y's dtype, contiguous
    block_n: int = EXPAND_BLOCK_N,  # one of EXPAND_BLOCK_NS: a tile program's columns of gate (and of up)
) -> torch.Tensor:
    """``out = silu(gate) * up`` for ``gate, up = (y + B(h)).chunk(2, -1)``: ``lora_expand`` over the two
    slices ``(0, I, 2I)`` and ``elementwise_triton.silu_and_mul`` in one launch, the sum rounded to y's
    dtype between them as there, so the output is theirs while ``y + B(h)`` never goes to memory.
    Programs: each base row's ``cdiv(I, SILU_BLOCK)`` column blocks (a row with a slot returns at
    once: its tile writes it), then each tile's ``cdiv(I, block_n)`` blocks."""
    num_rows, width = y.shape
    if width % 2 or lora_b.shape[1] != width or h.shape[1] != 2 * lora_b.shape[2]:
        raise ValueError(
            f"lora_expand_silu_and_mul: y [T, 2I], B [L, 2I, R] and h [T, 2R] expected, got y {tuple(y.shape)}, "
            f"B {tuple(lora_b.shape)}, h {tuple(h.shape)}"
        )
    if block_n not in EXPAND_BLOCK_NS:
        raise ValueError(f"lora_expand_silu_and_mul: block_n must be one of {EXPAND_BLOCK_NS}, got {block_n}")
    n_cols = width // 2
    if num_rows == 0 or n_cols == 0:
        return out
    rank = lora_b.shape[2]
    row_block = min(SILU_BLOCK, _next_power_of_2(n_cols))
    row_blocks = -(-n_cols // row_block)
    tile_blocks = -(-n_cols // block_n)
    lora_expand_silu_mul_kernel[(num_rows * row_blocks + tile_offsets.shape[0] * tile_blocks,)](
        y,
        out,
        h,
        lora_b,
        token_slots,
        sorted_rows,
        tile_offsets,
        tile_lens,
        tile_slots,
        num_rows,
        n_cols,
        row_blocks,
        tile_blocks,
        y.stride(0),
        out.stride(0),
        h.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        RANK=rank,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=_block_r(rank),
        BLOCK_N=block_n,
        ROW_BLOCK=row_block,
        DOT_F32=_INTERPRET,
        num_warps=4,
        **launch_options(out.device),
    )
    return out
