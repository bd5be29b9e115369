"""The canonical packed-integer weight layout that every loader produces and every kernel reads.

Knows: how 4- and 8-bit weight codes, their scales, zero points and act-order permutation are
laid out in memory. Must not know: which checkpoint format they came from (GPTQ, AWQ,
compressed-tensors all convert into this), or how kernels tile them.

Layout of ``PackedQuantWeight`` for a linear layer ``y = x @ W`` with ``x: [M, K]`` and
``W: [K, N]`` (``K`` = in_features, ``N`` = out_features):

* ``qweight``: int32 ``[K // pack_factor, N]`` with ``pack_factor = 32 // bits`` (8 for 4-bit,
  4 for 8-bit). Packed along K (dim 0), sequential, least significant bits first: the unsigned
  code ``q[k, n]`` of *packed row* ``k`` is ``(qweight[k // pf, n] >> (bits * (k % pf))) & mask``.
  This is bit-for-bit GPTQ's ``qweight`` orientation, so N is never packed and fused layers
  (qkv, gate_up) are plain concatenations along dim 1.
* ``scales``: ``[num_groups, N]`` in the dtype the checkpoint stored (fp16, bf16 or fp32), with
  ``num_groups = ceil(K / group_size)``; group ``g`` covers packed rows ``[g*G, (g+1)*G)``.
  ``group_size`` is always the effective size: per-channel checkpoints (-1) store ``K``.
* ``zeros``: ``None`` for symmetric weights (implicit zero ``2**(bits-1)``: 8 or 128), else
  uint8 ``[num_groups, N]`` holding the *true* zero point (no GPTQ-v1 "minus one").
* ``perm``: ``None`` unless the checkpoint used act-order with a non-trivial ``g_idx``; then
  int64 ``[K]`` and packed row ``k`` holds original input row ``perm[k]``. Rows were sorted by
  group once at load (``perm = argsort(g_idx, stable=True)``), so groups are contiguous in the
  packed order and the layer computes ``x[:, perm] @ dequant(qweight)``.

Dequantized value of packed row ``k``, column ``n``::

    W_packed[k, n] = scales[k // G, n] * (q[k, n] - zero[k // G, n])

A fused layer whose shards carry different permutations cannot share one ``perm``; such a layer
keeps its shards as separate ``PackedQuantWeight`` objects (see qserve.layers.quant_methods).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED_BITS = (4, 8)


def pack_factor(bits: int) -> int:
    """Codes per int32 word."""
    return 32 // bits


@dataclass
class PackedQuantWeight:
    """One quantized linear weight in the canonical layout (see the module docstring)."""

    bits: int
    group_size: int
    qweight: torch.Tensor  # int32 [K // pack_factor, N]
    scales: torch.Tensor  # [num_groups, N]
    zeros: torch.Tensor | None = None  # uint8 [num_groups, N], true zero point; None = symmetric
    perm: torch.Tensor | None = None  # int64 [K]; packed row k holds input row perm[k]

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits={self.bits} is not supported; supported: {SUPPORTED_BITS}")
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 2:
            raise ValueError(
                f"qweight must be a 2-D int32 tensor, got {self.qweight.dtype} {tuple(self.qweight.shape)}"
            )
        expected_groups = math.ceil(self.in_features / self.group_size)
        if tuple(self.scales.shape) != (expected_groups, self.out_features):
            raise ValueError(
                f"scales shape {tuple(self.scales.shape)} disagrees with qweight: expected "
                f"({expected_groups}, {self.out_features}) for K={self.in_features}, group_size={self.group_size}"
            )
        if self.zeros is not None and tuple(self.zeros.shape) != tuple(self.scales.shape):
            raise ValueError(
                f"zeros shape {tuple(self.zeros.shape)} must equal scales shape {tuple(self.scales.shape)}"
            )
        if self.perm is not None and tuple(self.perm.shape) != (self.in_features,):
            raise ValueError(f"perm shape {tuple(self.perm.shape)} must be ({self.in_features},)")

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * pack_factor(self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[0]

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def nbytes(self) -> int:
        """Bytes this weight occupies in memory, all tensors included."""
        tensors = [self.qweight, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def to(self, device: torch.device | str) -> PackedQuantWeight:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedQuantWeight(
            self.bits, self.group_size, move(self.qweight), move(self.scales), move(self.zeros), move(self.perm)
        )


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes from K-packed words: int32 [K/pf, N] -> int32 [K, N]."""
    pf = pack_factor(bits)
    shifts = torch.arange(pf, device=qweight.device, dtype=torch.int32) * bits  # [pf]
    codes = (qweight.unsqueeze(1) >> shifts.view(1, pf, 1)) & ((1 << bits) - 1)  # [K/pf, pf, N]
    return codes.reshape(-1, qweight.shape[1])


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``unpack_codes``: unsigned codes int [K, N] -> int32 [K/pf, N]."""
    pf = pack_factor(bits)
    if codes.shape[0] % pf:
        raise ValueError(f"K={codes.shape[0]} must be a multiple of {pf} to pack {bits}-bit codes")
    codes = codes.to(torch.int64).reshape(-1, pf, codes.shape[1])  # [K/pf, pf, N]
    shifts = torch.arange(pf, dtype=torch.int64, device=codes.device) * bits
    words = (codes << shifts.view(1, pf, 1)).sum(dim=1)  # [K/pf, N], fits in 32 unsigned bits
    # Reinterpret the unsigned 32-bit value as a signed int32.
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)
