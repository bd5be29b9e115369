"""compressed-tensors ``pack-quantized`` (llm-compressor W4A16 / W8A16) → canonical ``PackedQuantWeight``.

Knows: the tensors of one Linear (``weight_packed`` int32 [N, K/pf] packed along K holding
``q + 2^(b−1)``, ``weight_scale`` [N, ng], ``weight_shape`` int64 (N, K), optional
``weight_zero_point`` int32 [N/pf, ng] packed along N holding the unsigned true zero, optional
``weight_g_idx`` int32 [K]) — formats.md §4. The transpose of ``weight_packed`` is bit-for-bit the
canonical K-packed layout. Must not know: the engine or other formats.
"""

from __future__ import annotations

import torch

from loaders.common import SCALE_DTYPES, check_dtype, check_layer_shape, check_shape, effective_group, fetch
from loaders.packing import gather_k, perm_from_g_idx, unpack_n
from loaders.safetensors_io import CheckpointFiles
from loaders.spec import CheckpointSpec, ModuleQuant
from quant_kernels.layout import PackedQuantWeight, pack_factor

SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
MAIN_SUFFIX = "weight_packed"


def convert(
    files: CheckpointFiles,
    prefix: str,
    quant: ModuleQuant,
    spec: CheckpointSpec,
    expected_kn: tuple[int, int] | None,
) -> PackedQuantWeight:
    """Read ``prefix.weight_*`` and return the canonical weight."""
    bits = quant.bits
    pf = pack_factor(bits)
    packed_name = f"{prefix}.weight_packed"
    packed = fetch(files, packed_name, f"compressed-tensors layer {prefix}")  # int32 [N, K/pf]
    check_dtype(files, packed_name, packed, (torch.int32,), "pack-quantized int32 words")
    shape_name = f"{prefix}.weight_shape"
    weight_shape = fetch(files, shape_name, f"compressed-tensors layer {prefix}")  # int64 [2] = (N, K)
    if weight_shape.numel() != 2:
        raise ValueError(
            f"{files.file_of[shape_name]}: tensor {shape_name!r} must hold (N, K), got {weight_shape.tolist()}"
        )
    out_features, in_features = (int(v) for v in weight_shape.tolist())
    check_layer_shape(files, shape_name, (in_features, out_features), expected_kn, "weight_shape (N, K)")
    if in_features % pf:
        raise ValueError(
            f"{files.file_of[shape_name]}: tensor {shape_name!r}: K={in_features} is not a multiple of {pf}; "
            f"supported: {bits}-bit layers with K % {pf} == 0"
        )
    check_shape(
        files,
        packed_name,
        packed,
        (out_features, in_features // pf),
        f"[N, K/{pf}] for weight_shape (N={out_features}, K={in_features})",
    )
    qweight = packed.t().contiguous()  # int32 [K/pf, N], the canonical layout
    del packed
    group_size, num_groups = effective_group(quant.group_size, in_features)

    scale_name = f"{prefix}.weight_scale"
    scale = fetch(files, scale_name, f"compressed-tensors layer {prefix}")  # [N, ng]
    check_dtype(files, scale_name, scale, SCALE_DTYPES, "weight_scale")
    check_shape(files, scale_name, scale, (out_features, num_groups), f"[N, ng], group_size={quant.group_size}")
    scales = scale.t().contiguous()  # [ng, N]

    zeros = None
    if not quant.sym:
        zp_name = f"{prefix}.weight_zero_point"
        zp = fetch(files, zp_name, f"asymmetric compressed-tensors layer {prefix}")
        if zp.dtype == torch.int32 and tuple(zp.shape) == (-(-out_features // pf), num_groups):
            zeros = unpack_n(zp.t().contiguous(), bits, out_features).to(torch.uint8)  # [ng, N], unsigned true zero
        elif tuple(zp.shape) == (out_features, num_groups) and not zp.is_floating_point():
            # compressed-tensors < PR #296 stored the signed zero point unpacked.
            zeros = (zp.to(torch.int32) + (1 << (bits - 1))).t().contiguous().to(torch.uint8)  # [ng, N]
        else:
            check_shape(files, zp_name, zp, (-(-out_features // pf), num_groups), f"int32 [ceil(N/{pf}), ng]")

    perm = None
    g_idx_name = f"{prefix}.weight_g_idx"
    if g_idx_name in files:
        g_idx = files.get(g_idx_name)  # int32 [K]
        check_shape(files, g_idx_name, g_idx, (in_features,), "[K]")
        perm = perm_from_g_idx(g_idx, group_size, f"{files.file_of[g_idx_name]}: tensor {g_idx_name!r}")
        if perm is not None:
            qweight = gather_k(qweight, bits, perm)
    return PackedQuantWeight(bits=bits, group_size=group_size, qweight=qweight, scales=scales, zeros=zeros, perm=perm)
