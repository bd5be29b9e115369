"""AWQ GEMM (AutoAWQ / GPTQModel) → canonical ``PackedQuantWeight``.

Knows: the AWQ GEMM tensors of one Linear (``qweight`` int32 [K, N/8] and ``qzeros`` int32
[ng, N/8], both packed along N with the nibble interleave ``[0, 2, 4, 6, 1, 3, 5, 7]``, true zeros;
``scales`` [ng, N]; no ``g_idx``) — formats.md §3.2. GEMV / GEMV_fast / Marlin variants are refused
by ``loaders.detect`` before reaching here. Must not know: the engine or other formats.
"""

from __future__ import annotations

import torch

from loaders.common import (
    check_dtype,
    check_layer_shape,
    check_shape,
    effective_group,
    fetch,
    fetch_group_scales,
    fetch_words,
)
from loaders.packing import shift_into_slot, unpack_n
from loaders.safetensors_io import CheckpointFiles
from loaders.spec import CheckpointSpec, ModuleQuant
from quant_kernels.layout import PackedQuantWeight

SUFFIXES = ("qweight", "qzeros", "scales")
MAIN_SUFFIX = "qweight"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # slot i of a word holds column 8c + AWQ_ORDER[i]


def convert(
    files: CheckpointFiles,
    prefix: str,
    quant: ModuleQuant,
    spec: CheckpointSpec,
    expected_kn: tuple[int, int] | None,
) -> PackedQuantWeight:
    """Read ``prefix.{qweight,qzeros,scales}`` (AWQ GEMM) and return the canonical weight."""
    bits = 4
    qweight_name = f"{prefix}.qweight"
    awq_qweight = fetch_words(files, qweight_name, f"AWQ layer {prefix}", "AWQ GEMM int32 words")  # int32 [K, N/8]
    in_features, out_features = awq_qweight.shape[0], awq_qweight.shape[1] * 8
    check_layer_shape(files, qweight_name, (in_features, out_features), expected_kn, "AWQ GEMM qweight [K, N/8]")
    if in_features % 8:
        raise ValueError(
            f"{files.file_of[qweight_name]}: tensor {qweight_name!r}: K={in_features} must be a multiple of 8"
        )
    group_size, num_groups = effective_group(quant.group_size, in_features)

    scales_name = f"{prefix}.scales"
    scales = fetch_group_scales(
        files, scales_name, f"AWQ layer {prefix}", num_groups, out_features, quant.group_size
    )  # [ng, N]

    # Repack along K one slot at a time: K rows 8r + slot come from AWQ rows slot::8.
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int32)  # [K/8, N]
    for slot in range(8):
        codes = unpack_n(awq_qweight[slot::8], bits, out_features, AWQ_ORDER)  # [K/8, N]
        qweight += shift_into_slot(codes, slot, bits)
    del awq_qweight

    zeros = None
    qzeros_name = f"{prefix}.qzeros"
    if qzeros_name in files or not quant.sym:
        qzeros = fetch(files, qzeros_name, f"AWQ layer {prefix} with zero_point=true")  # int32 [ng, N/8]
        check_dtype(files, qzeros_name, qzeros, (torch.int32,), "AWQ GEMM int32 words")
        check_shape(files, qzeros_name, qzeros, (num_groups, out_features // 8), "[ng, N/8]")
        zeros = unpack_n(qzeros, bits, out_features, AWQ_ORDER).to(torch.uint8)  # [ng, N]
        if quant.sym and bool((zeros == 8).all()):
            zeros = None  # zero_point=false data written with explicit zeros of 8
    return PackedQuantWeight(bits=bits, group_size=group_size, qweight=qweight, scales=scales, zeros=zeros)
