"""Load-time repacking of the canonical layout into the W4A16 kernels' layout.

Knows: the canonical ``PackedQuantWeight`` (``quant_kernels.layout``) and the MMA-operand order
(``MmaQuantWeight``, ``mma_shuffle``; per MMA generation, see the comment block below) served by
``quant_kernels.w4a16_mma_triton`` and the fused MoE kernels. Must not know: how the kernels tile
M, models, checkpoint formats. Runs once per weight at load (``quant_kernels.ops.prepare_w4a16``),
never per call; the canonical weight stays the contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant_kernels.layout import PackedQuantWeight, pack_codes, pack_factor, unpack_codes

# ----------------------------------------------------------------------------------------------
# MMA-operand layout (the W4A16 kernel of quant_kernels.w4a16_mma_triton)
# ----------------------------------------------------------------------------------------------
#
# The weight is the MMA's A operand (swap-AB: the kernel computes ``(W^T x^T)^T``), a tile of
# ``[BLOCK_N, BLOCK_K]`` values with N as the MMA's M. In the register fragment of a 16-bit A
# operand (mma.sync m16n8k16 and wgmma alike, per warp) lane ``4*g + t`` holds rows ``g`` and
# ``g + 8`` of its 16-row block, and ``kw`` consecutive k per row in each of two halves of a
# ``8*kw``-wide k step (``kw``: the operand's k-width the compiler picks; 2 for fp16 operands).
# Stored order, per 16-row block and 64-wide k chunk, is that fragment order: one thread's 32
# values of the chunk (2 rows x 16 k) are contiguous (16 bytes for 4-bit), and the 8 lanes of
# two adjacent ``g`` share one 128-byte line. In value coordinates:
#
#   storage [N_pad / 4, K_pad * 4], row  r = blk16 * 4 + ga
#                                   col  c = kc * 256 + gl * 128 + t * 32 + (s, h, rh, e)
#   n = blk16 * 16 + rh * 8 + ga * 2 + gl      (g = 2 * ga + gl)
#   k = kc * 64 + s * 8kw + h * 4kw + t * kw + e     (s < 8 / kw, h < 2, e < kw)
#
# and the kernel undoes it with one reshape / permute / reshape of the dequantized tile, which
# the compiler's layout propagation turns into no data movement. Values are packed along the
# storage row into int32 words of ``vpw = 32 // bits`` values, half-word interleaved so that one
# ``lop3`` yields a half2 of two consecutive values: value ``2i`` of a word is field ``i`` and
# value ``2i + 1`` is field ``i + vpw/2``. K is padded with the code that dequantizes to zero
# (2**(bits-1)), N with the same.

MMA_BLOCK_N = 16  # rows of one A-fragment block
MMA_CHUNK_K = 64  # k of one stored chunk
MMA_PAD_K = 128  # K is padded to whole 128-wide tiles (the kernel's largest BLOCK_K)
MMA_PAD_N = 64  # N is padded to whole 64-row tiles (one wgmma M)


@dataclass
class MmaQuantWeight:
    """A quantized weight pre-shuffled to the MMA A-operand order (see the comment block above)."""

    bits: int
    group_size: int
    in_features: int  # K (logical)
    out_features: int  # N (logical)
    kwidth: int  # the A operand's k-width the layout was built for (2 / 4 / 8)
    qweight: torch.Tensor  # int32 [N_pad // 4, K_pad * 4 // vpw]
    scales: torch.Tensor  # [num_groups, N] as in the canonical weight
    # fp16 [num_groups, N] holding z - 2**(bits-1) (exact); None = symmetric. Not uint8: an 8-bit
    # input to the A operand makes Triton widen the operand's k-width on sm80-89 (see the kernel).
    zeros: torch.Tensor | None = None
    perm: torch.Tensor | None = None  # int64 [K]

    @property
    def k_pad(self) -> int:
        return self.qweight.shape[1] * pack_factor(self.bits) // 4

    @property
    def n_pad(self) -> int:
        return self.qweight.shape[0] * 4


def _triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton; (0, 0) when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = version("triton").split(".")[:2]
        return int(major), int(minor)
    except (PackageNotFoundError, ValueError):
        return (0, 0)


def mma_kwidth(capability: tuple[int, int], triton_version: tuple[int, int] | None = None) -> int:
    """The A operand's k-width for a device: the layout generation chosen at load time.

    Hopper (wgmma, sm90) takes a 16-bit A fragment with k-width 2 when the operand is produced in
    registers from 32-bit words. Ampere/Ada (mma.sync, sm80-89) takes k-width 2 from Triton 3.8
    on, but Triton 3.6 and 3.7 lay the register operand out with k-width 4 there: a k-width-2
    layout compiled for sm86 by them sends the dequantized tile through shared memory (290 B per
    thread stored in the decode kernel against 34 B with k-width 4; Triton 3.8 and 3.9: the
    reverse). Both were read from the PTX by tests/kernels/test_w4a16_ptx.py, which checks the
    choice made here for the installed Triton.
    """
    major, _ = capability
    if major >= 9:
        return 2
    if major == 8:
        return 4 if (triton_version or _triton_version()) < (3, 8) else 2
    raise ValueError(f"compute capability {capability} has no 16-bit MMA path for the W4A16 kernel (needs sm80+)")


def _mma_dims(n_pad: int, k_pad: int, kw: int) -> tuple[int, ...]:
    """Value-coordinate dims (blk16, rh, ga, gl, kc, s, h, t, e) of an [N_pad, K_pad] tile."""
    return (n_pad // 16, 2, 4, 2, k_pad // 64, 8 // kw, 2, 4, kw)


# (blk16, rh, ga, gl, kc, s, h, t, e) -> stored (blk16, ga, kc, gl, t, s, h, rh, e); the kernel
# applies the inverse permutation (0, 7, 1, 3, 2, 5, 6, 4, 8).
_MMA_TO_STORED = (0, 2, 4, 3, 7, 5, 6, 1, 8)


def _word_value_order(bits: int) -> torch.Tensor:
    """Field of the int32 word that holds value v of the word, for v in [0, vpw): int64 [vpw]."""
    vpw = pack_factor(bits)
    half = vpw // 2
    return torch.tensor([i // 2 + (half if i % 2 else 0) for i in range(vpw)], dtype=torch.int64)


def mma_storage_shape(k: int, n: int, bits: int) -> tuple[int, int]:
    """``MmaQuantWeight.qweight``'s shape for a ``[K, N]`` weight: int32 ``[N_pad / 4, K_pad * 4 / vpw]``."""
    k_pad = -(-k // MMA_PAD_K) * MMA_PAD_K
    n_pad = -(-n // MMA_PAD_N) * MMA_PAD_N
    return n_pad // 4, k_pad * 4 // pack_factor(bits)


def mma_shuffle(weight: PackedQuantWeight, kwidth: int = 2, chunk_n: int = 1024) -> MmaQuantWeight:
    """Canonical -> MMA-operand order, in column chunks of the canonical weight (bounded memory)."""
    if kwidth not in (2, 4, 8):
        raise ValueError(f"kwidth must be 2, 4 or 8, got {kwidth}")
    bits, vpw = weight.bits, pack_factor(weight.bits)
    k, n = weight.in_features, weight.out_features
    k_pad = -(-k // MMA_PAD_K) * MMA_PAD_K
    n_pad = -(-n // MMA_PAD_N) * MMA_PAD_N
    chunk_n = max(MMA_PAD_N, chunk_n // MMA_PAD_N * MMA_PAD_N)
    device = weight.qweight.device
    zero_code = 1 << (bits - 1)
    fields = _word_value_order(bits).to(device)  # [vpw]
    shifts = (fields * bits).view(1, 1, vpw)
    out = torch.empty(mma_storage_shape(k, n, bits), dtype=torch.int32, device=device)
    for n0 in range(0, n_pad, chunk_n):
        n1 = min(n0 + chunk_n, n_pad)
        codes = torch.full((n1 - n0, k_pad), zero_code, dtype=torch.int64, device=device)  # [n_chunk, K_pad]
        if n0 < n:
            part = unpack_codes(weight.qweight[:, n0 : min(n1, n)], bits)  # [K, <=n_chunk]
            codes[: part.shape[1], :k] = part.t()
        stored = codes.view(_mma_dims(n1 - n0, k_pad, kwidth)).permute(_MMA_TO_STORED)
        stored = stored.reshape((n1 - n0) // 4, -1, vpw)  # [rows, words, vpw] values in word order
        words = (stored << shifts).sum(dim=-1)  # unsigned 32-bit values
        out[n0 // 4 : n1 // 4] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return MmaQuantWeight(bits, weight.group_size, k, n, kwidth, out, weight.scales, mma_zeros(weight), weight.perm)


def mma_zeros(weight: PackedQuantWeight) -> torch.Tensor | None:
    """The zero points as ``MmaQuantWeight`` keeps them: fp16 ``z - 2**(bits-1)`` [num_groups, N]."""
    if weight.zeros is None:
        return None
    return (weight.zeros.to(torch.int32) - (1 << (weight.bits - 1))).to(torch.float16)


def mma_unshuffle(shuffled: MmaQuantWeight) -> PackedQuantWeight:
    """Inverse of ``mma_shuffle`` (tests, debugging, and a CUDA-prepared weight used off CUDA)."""
    bits = shuffled.bits
    k, n, k_pad, n_pad = shuffled.in_features, shuffled.out_features, shuffled.k_pad, shuffled.n_pad
    fields = _word_value_order(bits).to(shuffled.qweight.device)
    words = shuffled.qweight.to(torch.int64) & 0xFFFFFFFF  # [rows, words]
    values = (words.unsqueeze(-1) >> (fields * bits)) & ((1 << bits) - 1)  # [rows, words, vpw]
    dims = _mma_dims(n_pad, k_pad, shuffled.kwidth)
    stored_dims = tuple(dims[i] for i in _MMA_TO_STORED)
    inverse = tuple(sorted(range(9), key=lambda i: _MMA_TO_STORED[i]))
    codes = values.reshape(stored_dims).permute(inverse).reshape(n_pad, k_pad)  # [N_pad, K_pad]
    zeros = None
    if shuffled.zeros is not None:
        zeros = (shuffled.zeros.to(torch.int32) + (1 << (bits - 1))).to(torch.uint8)
    return PackedQuantWeight(
        bits, shuffled.group_size, pack_codes(codes[:n, :k].t(), bits), shuffled.scales, zeros, shuffled.perm
    )
