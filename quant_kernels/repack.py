"""Load-time repacking of the canonical layout into the Triton kernels' tile-interleaved layout.

Knows: the canonical ``PackedQuantWeight`` (``quant_kernels.layout``) and the kernel layout below.
Must not know: how the kernels tile N or M, models, checkpoint formats. Runs once per weight at
load (``quant_kernels.ops.prepare_w4a16``), never per call.

Tile-interleaved layout (``TiledQuantWeight``), for ``pf = 32 // bits`` codes per int32 word and an
interleave ``ib`` (word rows per K-tile, 16 by default), so one K-tile holds ``BK = pf * ib``
packed rows:

* ``qweight``: int32 ``[K_pad // pf, N]`` with ``K_pad = ceil(K / BK) * BK`` (padding codes are 0).
  Word row ``t * ib + r`` holds, in bits ``[bits*j, bits*(j+1))``, the code of packed row
  ``k = t * BK + j * ib + r``. So the ``j``-th code of the words of one K-tile covers the
  *contiguous* packed rows ``[t*BK + j*ib, t*BK + (j+1)*ib)``: a kernel extracts code ``j`` of a
  ``[ib, BLOCK_N]`` word tile and multiplies it with a contiguous slice of x (no gather).
* ``scales``, ``zeros``, ``perm``: unchanged from the canonical weight (indexed by packed row k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant_kernels.layout import PackedQuantWeight, pack_codes, pack_factor, unpack_codes

DEFAULT_INTERLEAVE = 16


@dataclass
class TiledQuantWeight:
    """A quantized weight in the tile-interleaved kernel layout (see the module docstring)."""

    bits: int
    group_size: int
    in_features: int  # K (logical; qweight is padded to a multiple of pf * interleave)
    interleave: int  # ib: word rows per K-tile
    qweight: torch.Tensor  # int32 [K_pad // pf, N]
    scales: torch.Tensor  # [num_groups, N]
    zeros: torch.Tensor | None = None  # uint8 [num_groups, N]; None = symmetric
    perm: torch.Tensor | None = None  # int64 [K]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def block_k(self) -> int:
        """Packed rows per K-tile."""
        return pack_factor(self.bits) * self.interleave


def _tile_order(k_pad: int, bits: int, ib: int, device: torch.device) -> torch.Tensor:
    """Row order so that packing consecutive pf rows gives the tiled words: int64 [K_pad]."""
    pf = pack_factor(bits)
    t, r, j = torch.meshgrid(
        torch.arange(k_pad // (pf * ib), device=device),
        torch.arange(ib, device=device),
        torch.arange(pf, device=device),
        indexing="ij",
    )
    return (t * (pf * ib) + j * ib + r).reshape(-1)  # position (t, r, j) holds packed row k


def tile_interleave(
    weight: PackedQuantWeight, interleave: int = DEFAULT_INTERLEAVE, chunk_n: int = 4096
) -> TiledQuantWeight:
    """Canonical -> tile-interleaved, column chunk by column chunk (bounded temporary memory)."""
    bits, pf = weight.bits, pack_factor(weight.bits)
    k, n = weight.in_features, weight.out_features
    block_k = pf * interleave
    k_pad = -(-k // block_k) * block_k
    device = weight.qweight.device
    order = _tile_order(k_pad, bits, interleave, device)  # [K_pad]
    shifts = (torch.arange(pf, device=device, dtype=torch.int64) * bits).view(1, pf, 1)
    out = torch.empty((k_pad // pf, n), dtype=torch.int32, device=device)  # [K_pad/pf, N]
    for n0 in range(0, n, chunk_n):
        codes = unpack_codes(weight.qweight[:, n0 : n0 + chunk_n], bits)  # [K, n_chunk]
        if k_pad != k:
            codes = torch.cat([codes, codes.new_zeros(k_pad - k, codes.shape[1])])
        codes = codes[order].to(torch.int64).view(k_pad // pf, pf, -1)  # [K_pad/pf, pf, n_chunk]
        words = (codes << shifts).sum(dim=1)  # [K_pad/pf, n_chunk], unsigned 32-bit values
        out[:, n0 : n0 + chunk_n] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return TiledQuantWeight(bits, weight.group_size, k, interleave, out, weight.scales, weight.zeros, weight.perm)


def untile(tiled: TiledQuantWeight) -> PackedQuantWeight:
    """Inverse of ``tile_interleave`` (tests and debugging)."""
    bits = tiled.bits
    codes = unpack_codes(tiled.qweight, bits)  # [K_pad, N] in (t, r, j) order
    order = _tile_order(codes.shape[0], bits, tiled.interleave, codes.device)
    canonical = torch.empty_like(codes)
    canonical[order] = codes
    return PackedQuantWeight(
        bits,
        tiled.group_size,
        pack_codes(canonical[: tiled.in_features], bits),
        tiled.scales,
        tiled.zeros,
        tiled.perm,
    )
