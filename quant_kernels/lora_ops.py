"""Device dispatch for multi-LoRA: ``add_lora`` (``y += scale * B(A(x))`` per row, each row with its
own adapter slot) and ``build_lora_indices`` (a step's per-row slots and their Punica-style tiles).

Knows: which implementation serves which device (the PyTorch reference everywhere; the Triton
kernels on CUDA only when ``QSERVE_LORA_TRITON=1``, until ``pytest -m gpu`` has run with them), and
how rows are grouped into tiles of one slot. Must not know: models, layers, PEFT, engines. Triton stays
a lazy import. Layout and numerics: ``quant_kernels.reference_lora``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from quant_kernels import device as kdevice
from quant_kernels import reference_lora

TILE_ROWS = 16  # = lora_triton.TILE_ROWS (not imported: triton stays lazy)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
TRITON_ENV = "QSERVE_LORA_TRITON"


@dataclass(frozen=True, slots=True)
class LoRAIndices:
    """Which adapter slot each row of a step uses, shared by every LoRA layer of the step.

    ``token_slots`` serves the reference; the tiles serve the kernels: the rows with a slot, sorted
    by slot (stable: a prefill segment stays in order) and cut into runs of at most ``TILE_ROWS`` rows
    of one slot.
    """

    token_slots: torch.Tensor  # int32 [T], -1: base row
    sorted_rows: torch.Tensor  # int32 [T_lora]
    tile_offsets: torch.Tensor  # int32 [G]: start of each tile in sorted_rows
    tile_lens: torch.Tensor  # int32 [G]: rows in each tile (1..TILE_ROWS)
    tile_slots: torch.Tensor  # int32 [G]: the tile's slot


def max_lora_tiles(num_rows: int, max_loras: int) -> int:
    """The most tiles ``num_rows`` rows over at most ``max_loras`` adapters can take (each adapter's
    rows end in one partial tile): the fixed tile count of a CUDA graph's indices."""
    return -(-num_rows // TILE_ROWS) + min(max_loras, num_rows)


def lora_tiles(token_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(sorted_rows [T_lora], tile_offsets [G], tile_lens [G], tile_slots [G])`` (int32) of a step
    whose row ``t`` uses slot ``token_slots[t]`` (-1: base). Host numpy, no per-row Python loop."""
    slots = np.asarray(token_slots, dtype=np.int32)  # [T]
    rows = np.flatnonzero(slots >= 0)  # [T_lora]
    rows = rows[np.argsort(slots[rows], kind="stable")].astype(np.int32)
    sorted_slots = slots[rows]  # [T_lora]
    # Runs of one slot, then each run cut into pieces of TILE_ROWS.
    run_starts = np.flatnonzero(np.r_[True, sorted_slots[1:] != sorted_slots[:-1]])[: len(rows)]  # [runs]
    run_ends = np.r_[run_starts[1:], len(rows)][: len(run_starts)].astype(np.int64)  # [runs]
    pieces = -(-(run_ends - run_starts) // TILE_ROWS)  # [runs]
    first_piece = np.repeat(run_starts, pieces)
    piece_index = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    offsets = first_piece + piece_index * TILE_ROWS  # [G]
    lens = np.minimum(np.repeat(run_ends, pieces) - offsets, TILE_ROWS)  # [G]
    as32 = np.int32
    return rows, offsets.astype(as32), lens.astype(as32), sorted_slots[offsets].astype(as32)


def build_lora_indices(token_slots: np.ndarray, device: torch.device) -> LoRAIndices:
    """Indices for a step whose row ``t`` uses slot ``token_slots[t]`` (-1: base); one host-to-device
    copy per array."""

    def put(array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
        return tensor if device.type == "cpu" else tensor.pin_memory().to(device, non_blocking=True)

    return LoRAIndices(put(token_slots), *(put(a) for a in lora_tiles(token_slots)))


def triton_enabled() -> bool:
    """``QSERVE_LORA_TRITON=1``: the opt-in for the Triton kernels on CUDA."""
    return os.environ.get(TRITON_ENV, "") == "1"


def _triton_usable(*tensors: torch.Tensor) -> bool:
    return (
        triton_enabled()
        and all(kdevice.triton_serves(t.device) for t in tensors)
        and tensors[0].dtype in _KERNEL_DTYPES
        and all(t.stride(-1) == 1 for t in tensors)
    )


def add_lora(
    y: torch.Tensor,  # [T, N]: the base layer's output, updated in place
    x: torch.Tensor,  # [T, K]: the layer's input
    lora_a: torch.Tensor,  # [L, S * R, K]
    lora_b: torch.Tensor,  # [L, N, R]
    slice_starts: Sequence[int],  # S + 1 bounds of the output slices along N
    indices: LoRAIndices,
) -> torch.Tensor:
    """``y[t] += B[slot t](A[slot t](x[t]))`` (the scale is folded into B) for rows with a slot."""
    num_slices = len(slice_starts) - 1
    h = torch.empty((x.shape[0], lora_a.shape[1]), dtype=x.dtype, device=x.device)  # [T, S * R]
    if _triton_usable(x, y, lora_a, lora_b):
        from quant_kernels import lora_triton

        tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
        lora_triton.lora_shrink(x, lora_a, *tiles, num_slices, h)
        return lora_triton.lora_expand(y, h, lora_b, *tiles, slice_starts)
    reference_lora.lora_shrink(x, lora_a, indices.token_slots, h)
    return reference_lora.lora_expand(y, h, lora_b, indices.token_slots, slice_starts)
