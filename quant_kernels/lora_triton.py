"""Triton kernels for multi-LoRA, Punica style: a grouped shrink (``h = x @ A^T``) and a grouped
expand (``y += h @ B^T``) over the token rows of a step, each row with its own adapter slot.

Knows: the layout and numerics of ``quant_kernels.reference_lora`` and the row grouping of
``quant_kernels.lora_ops.LoRAIndices``. Must not know: models, layers, PEFT files, engines. Imported
lazily (by ``quant_kernels.lora_ops`` on CUDA when ``QSERVE_LORA_TRITON=1``, or by tests under
``TRITON_INTERPRET=1``).

Grouping: the rows of a step that use an adapter are sorted by slot (``sorted_rows``) and cut into
tiles of at most ``TILE_ROWS`` rows of ONE slot (``tile_offsets`` / ``tile_lens`` / ``tile_slots``);
a tile of length 0 is padding (a CUDA graph's fixed tile count) and does nothing.
A tile of a prefill segment is up to 16 consecutive tokens of one sequence; in a decode step the
rows of every sequence on the same adapter share tiles, so an adapter's A and B are read once per
16 rows, not once per row (the point of Punica's grouped GEMMs). Rows of the base model are in no
tile: the kernels never touch them.

Kernels
-------
``lora_shrink_kernel``: grid ``(num_tiles, S)``: the tile's ``[TILE_ROWS, K]`` rows of ``x`` (gathered
  through ``sorted_rows``) times slice ``s``'s ``[R, K]`` block of ``A`` of the tile's slot, K in
  ``BLOCK_K`` steps, fp32 accumulator, stored rounded to the activation dtype at ``h[row, s*R:]``.
``lora_expand_kernel``: grid ``(num_tiles, ceil(max_slice / BLOCK_N), S)``: the tile's ``[TILE_ROWS, R]``
  of ``h`` times ``BLOCK_N`` rows of slice ``s`` of ``B``, added in fp32 to the base output ``y``
  (read, add, one rounding, write back: each row lives in one tile, so no two programs write it).
  Programs past the end of a shorter slice mask everything out.

Both allocate nothing, never synchronise with the host and launch a grid fixed by host integers.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

TILE_ROWS = 16  # rows per tile (the MMA's smallest M); lora_ops builds tiles of this size
SHRINK_BLOCK_K = 64
EXPAND_BLOCK_N = 64
# Under TRITON_INTERPRET=1 (CPU tests) bf16 tl.dot gives garbage in Triton 3.6's interpreter (as
# attention_triton notes): the dots run in fp32 there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def lora_shrink_kernel(
    X,
    A,
    OUT,
    ROWS,
    TILE_OFF,
    TILE_LEN,
    TILE_SLOT,
    K,
    stride_xm,
    stride_al,
    stride_ar,
    stride_om,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    s = tl.program_id(1)
    first = tl.load(TILE_OFF + tile)
    count = tl.load(TILE_LEN + tile)
    slot = tl.load(TILE_SLOT + tile).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    row_mask = m < count
    rows = tl.load(ROWS + first + m, mask=row_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    a_rows = (s * RANK + r).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_end = tl.where(count > 0, K, 0)  # an empty tile (a CUDA graph's padding) reads nothing
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(
            A + slot * stride_al + a_rows[None, :] * stride_ar + k[:, None],
            mask=r_mask[None, :] & k_mask[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_R]
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), a.to(tl.float32))
        else:
            acc += tl.dot(x, a)
    out = OUT + rows[:, None] * stride_om + (s * RANK + r)[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=row_mask[:, None] & r_mask[None, :])


@triton.jit
def lora_expand_kernel(
    Y,
    H,
    B,
    ROWS,
    TILE_OFF,
    TILE_LEN,
    TILE_SLOT,
    n_bound0,
    n_bound1,
    n_bound2,
    n_bound3,
    stride_ym,
    stride_hm,
    stride_bl,
    stride_bn,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    tile = tl.program_id(0)
    block_n = tl.program_id(1)
    s = tl.program_id(2)
    n_lo = tl.where(s == 0, n_bound0, tl.where(s == 1, n_bound1, n_bound2))
    n_hi = tl.where(s == 0, n_bound1, tl.where(s == 1, n_bound2, n_bound3))
    first = tl.load(TILE_OFF + tile)
    count = tl.load(TILE_LEN + tile)
    slot = tl.load(TILE_SLOT + tile).to(tl.int64)
    m = tl.arange(0, BLOCK_M)
    row_mask = m < count
    rows = tl.load(ROWS + first + m, mask=row_mask, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < RANK
    n = (n_lo + block_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = n < n_hi
    h = tl.load(
        H + rows[:, None] * stride_hm + (s * RANK + r)[None, :], mask=row_mask[:, None] & r_mask[None, :], other=0.0
    )  # [BLOCK_M, BLOCK_R]
    b = tl.load(
        B + slot * stride_bl + n[None, :] * stride_bn + r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0
    )  # [BLOCK_R, BLOCK_N]
    if DOT_F32:
        acc = tl.dot(h.to(tl.float32), b.to(tl.float32))  # [BLOCK_M, BLOCK_N]
    else:
        acc = tl.dot(h.to(b.dtype), b)  # [BLOCK_M, BLOCK_N] fp32
    mask = row_mask[:, None] & n_mask[None, :]
    y_ptr = Y + rows[:, None] * stride_ym + n[None, :]
    y = tl.load(y_ptr, mask=mask, other=0.0)
    tl.store(y_ptr, (y.to(tl.float32) + acc).to(Y.dtype.element_ty), mask=mask)


def _block_r(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def lora_shrink(
    x: torch.Tensor,  # [T, K], last dim contiguous
    lora_a: torch.Tensor,  # [L, S * R, K], last dim contiguous
    sorted_rows: torch.Tensor,  # int32 [T_lora]
    tile_offsets: torch.Tensor,  # int32 [G]
    tile_lens: torch.Tensor,  # int32 [G]
    tile_slots: torch.Tensor,  # int32 [G]
    num_slices: int,
    out: torch.Tensor,  # [T, S * R], x's dtype, last dim contiguous
) -> torch.Tensor:
    """``out[row] = x[row] @ A[slot]^T`` for the rows of every tile (see the module doc)."""
    num_tiles = tile_offsets.shape[0]
    if num_tiles == 0:
        return out
    rank = lora_a.shape[1] // num_slices
    lora_shrink_kernel[(num_tiles, num_slices)](
        x,
        lora_a,
        out,
        sorted_rows,
        tile_offsets,
        tile_lens,
        tile_slots,
        x.shape[1],
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        out.stride(0),
        RANK=rank,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=_block_r(rank),
        BLOCK_K=SHRINK_BLOCK_K,
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
) -> torch.Tensor:
    """``y[row, slice s] += h[row, s*R:(s+1)*R] @ B[slot, slice s]^T`` for the rows of every tile."""
    num_tiles = tile_offsets.shape[0]
    num_slices = len(slice_starts) - 1
    if num_tiles == 0:
        return y
    if not 1 <= num_slices <= 3:
        raise ValueError(f"lora_expand: 1 to 3 output slices, got {num_slices}")
    bounds = list(slice_starts) + [slice_starts[-1]] * (4 - len(slice_starts))
    widest = max(slice_starts[i + 1] - slice_starts[i] for i in range(num_slices))
    rank = lora_b.shape[2]
    grid = (num_tiles, triton.cdiv(widest, EXPAND_BLOCK_N), num_slices)
    lora_expand_kernel[grid](
        y,
        h,
        lora_b,
        sorted_rows,
        tile_offsets,
        tile_lens,
        tile_slots,
        *bounds,
        y.stride(0),
        h.stride(0),
        lora_b.stride(0),
        lora_b.stride(1),
        RANK=rank,
        BLOCK_M=TILE_ROWS,
        BLOCK_R=_block_r(rank),
        BLOCK_N=EXPAND_BLOCK_N,
        DOT_F32=_INTERPRET,
        num_warps=4,
    )
    return y
