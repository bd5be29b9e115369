"""Bit-level helpers shared by the converters: unpack N-packed words, pack codes along K, gather
K rows of packed weights, GPTQ v1→v2 zero words, act-order ``g_idx`` → permutation.

Knows: sequential and interleaved little-endian packing of 4/8-bit codes in int32 words and the
canonical K-packed layout of ``quant_kernels.layout``. Must not know: checkpoint formats or
tensor names. Every helper works slot by slot (one of the ``32 / bits`` positions in a word at a
time) so that its transient memory stays about the size of its output, never the 8x of a fully
unpacked int32 code matrix.
"""

from __future__ import annotations

import torch

from quant_kernels.layout import pack_factor

# GPTQ v1 stores zero - 1 per code; GPTQModel subtracts these per-word constants (with borrow).
V1_WORD_OFFSET = {4: 0x11111111, 8: 0x01010101}


def shift_into_slot(codes: torch.Tensor, slot: int, bits: int) -> torch.Tensor:
    """``codes << (bits * slot)`` as int32 without signed overflow (top slot wraps to negative)."""
    codes = codes.to(torch.int32)
    if slot == pack_factor(bits) - 1:
        half = 1 << (bits - 1)
        codes = torch.where(codes >= half, codes - (1 << bits), codes)  # the word's sign bits
    return codes * (1 << (bits * slot))


def pack_k(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes int [K, N] -> int32 [K / pf, N], packed along K, sequential, LSB first."""
    pf = pack_factor(bits)
    num_rows, num_cols = codes.shape
    if num_rows % pf:
        raise ValueError(f"K={num_rows} must be a multiple of {pf} to pack {bits}-bit codes")
    words = torch.zeros(num_rows // pf, num_cols, dtype=torch.int32)  # [K/pf, N]
    for slot in range(pf):
        words += shift_into_slot(codes[slot::pf], slot, bits)
    return words


def unpack_n(words: torch.Tensor, bits: int, num_cols: int, order: list[int] | None = None) -> torch.Tensor:
    """Words int32 [R, ceil(N / pf)] packed along N -> int32 codes [R, N].

    ``order[i]`` names the column (within a word's ``pf`` columns) that slot ``i`` holds; None means
    sequential. AWQ GEMM uses ``order = [0, 2, 4, 6, 1, 3, 5, 7]``.
    """
    pf = pack_factor(bits)
    mask = (1 << bits) - 1
    order = order or list(range(pf))
    codes = torch.empty(words.shape[0], words.shape[1], pf, dtype=torch.int32)  # [R, N/pf, pf]
    for slot, col in enumerate(order):
        codes[:, :, col] = (words >> (bits * slot)) & mask
    return codes.reshape(words.shape[0], -1)[:, :num_cols]


def gather_k(qweight: torch.Tensor, bits: int, rows: torch.Tensor) -> torch.Tensor:
    """Repack K-packed words so that packed row ``k`` holds old row ``rows[k]``.

    ``qweight``: int32 [K / pf, N]; ``rows``: int64 [K]. Returns int32 [K / pf, N].
    """
    pf = pack_factor(bits)
    mask = (1 << bits) - 1
    out = torch.zeros_like(qweight)  # [K/pf, N]
    for slot in range(pf):
        src = rows[slot::pf]  # [K/pf]
        shifts = ((src % pf) * bits).to(torch.int32).unsqueeze(1)  # [K/pf, 1]
        codes = (qweight[src // pf] >> shifts) & mask  # [K/pf, N]
        out += shift_into_slot(codes, slot, bits)
    return out


def v1_words_to_v2(words: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ v1 zero words -> v2 (true zero) words by whole-word 32-bit addition.

    This exactly inverts GPTQModel's whole-word subtraction (including its borrow when a zero is
    0) and equals AutoGPTQ's per-code ``+1`` whenever no stored code is 15 (4-bit) / 255 (8-bit).
    """
    wide = (words.to(torch.int64) + V1_WORD_OFFSET[bits]) & 0xFFFFFFFF
    return torch.where(wide >= 2**31, wide - 2**32, wide).to(torch.int32)


def perm_from_g_idx(g_idx: torch.Tensor, group_size: int, where: str) -> torch.Tensor | None:
    """Act-order permutation (int64 [K]) from ``g_idx`` [K], or None when ``g_idx`` is trivial.

    ``group_size`` is the effective size (K for per-channel). The packed rows are sorted by group
    (stable), so group ``g`` then covers rows ``[g * G, (g + 1) * G)`` as the canonical layout needs.
    """
    groups = g_idx.to(torch.int64)  # [K]
    num_rows = groups.shape[0]
    trivial = torch.arange(num_rows, dtype=torch.int64) // group_size  # [K]
    if torch.equal(groups, trivial):
        return None
    perm = torch.argsort(groups, stable=True)  # [K]
    if not torch.equal(groups[perm], trivial):
        counts = torch.bincount(groups.clamp(min=0)).tolist()
        raise ValueError(
            f"{where}: g_idx is not a valid act-order grouping for group_size={group_size}, K={num_rows} "
            f"(members per group: {counts[:8]}{'...' if len(counts) > 8 else ''}); every group must have exactly "
            "group_size rows"
        )
    return perm
