"""Device dispatch for the quantized-linear op: Triton kernels on CUDA, the reference elsewhere.

Knows: which implementation serves which device, and the one-time preparation of a weight for
it (``prepare_w4a16``: the kernel layout is produced here once at load, never per call). Must
not know: models or checkpoint formats. Triton stays an optional, lazy import: this module
imports on a machine without triton, and only the CUDA branch touches it.

On CUDA, preparation shuffles the canonical weight once into the MMA-operand order of this
device's generation (``quant_kernels.repack.mma_shuffle``, served by
``quant_kernels.w4a16_mma_triton``, one kernel family: its Triton and Gluon launches) and
allocates the split-K arrival counters. On sm80 and newer that kernel serves every group size in
steps of 16 rows (48 or 80 included: the padded act-order groups of a row-parallel shard) and
those that divide its K-tiles (``w4a16_mma_triton.supports``); a weight it cannot serve (other
group sizes, an older card) stays canonical and takes the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from quant_kernels import device as kdevice
from quant_kernels import reference
from quant_kernels.layout import PackedQuantWeight


@dataclass
class W4A16Prepared:
    """A weight ready for a Triton kernel: the kernel-layout weight plus per-weight scratch.

    ``weight`` is a ``quant_kernels.repack.MmaQuantWeight``. ``counters`` (int32, zeros) are the
    split-K arrival counters: each split-K launch leaves them at zero again, so they are allocated
    once here and never reset per call.
    """

    weight: Any  # MmaQuantWeight (typed loosely: this module must import without triton)
    counters: torch.Tensor  # int32 [num_split_counters(N)]

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    @property
    def out_features(self) -> int:
        return self.weight.out_features


def prepare_w4a16(weight: PackedQuantWeight) -> Any:
    """Turn a canonical weight (already on its device) into what ``w4a16_linear`` consumes.

    On CUDA with triton available: a ``W4A16Prepared``; elsewhere the weight itself.
    """
    if not kdevice.triton_serves(weight.qweight.device):
        return weight
    from quant_kernels import w4a16_mma_triton

    if not w4a16_mma_triton.supports(weight):
        return weight
    counters = torch.zeros(
        w4a16_mma_triton.num_split_counters(weight.out_features), dtype=torch.int32, device=weight.qweight.device
    )  # [num_split_counters(N)]
    return W4A16Prepared(weight=w4a16_mma_triton.prepare(weight), counters=counters)


def w4a16_linear(x: torch.Tensor, prepared: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x: [..., K] -> [..., N]`` from a weight made by ``prepare_w4a16``."""
    if isinstance(prepared, W4A16Prepared) and kdevice.triton_serves(x.device):
        from quant_kernels import w4a16_mma_triton

        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        out = w4a16_mma_triton.w4a16_gemm(x2, prepared.weight, bias, counters=prepared.counters)  # [M, N]
        return out.reshape(*lead, out.shape[-1])
    if isinstance(prepared, W4A16Prepared):  # a CUDA-prepared weight used off CUDA: undo the kernel layout
        from quant_kernels.repack import mma_unshuffle

        prepared = mma_unshuffle(prepared.weight)
    return reference.w4a16_matmul(x, prepared, bias)


def warmup_w4a16(prepared: Any, dtype: torch.dtype, ms: list[int]) -> None:
    """Compile the kernels each M will use (call before CUDA-graph capture). No-op off CUDA."""
    if not isinstance(prepared, W4A16Prepared):
        return
    for m in ms:
        device = prepared.weight.qweight.device
        x = torch.randn((m, prepared.in_features), dtype=dtype, device=device)  # [M, K]
        w4a16_linear(x, prepared)
