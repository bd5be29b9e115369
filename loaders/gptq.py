"""GPTQ (AutoGPTQ / GPTQModel / optimum) → canonical ``PackedQuantWeight``.

Knows: the GPTQ tensors of one Linear (``qweight`` int32 [K/pf, N] packed along K, ``qzeros`` int32
[ng, N/pf] packed along N, ``scales`` [ng, N], optional ``g_idx`` int32 [K]) and the v1 ("zero − 1",
whole-word) and v2 (true zero) zero conventions (formats.md §2). Symmetric weights ignore
``qzeros`` entirely (implicit zero 2^(b−1)), as vLLM does, which makes them immune to v1/v2
mislabelling. Must not know: the engine or other formats.
"""

from __future__ import annotations

import logging

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
from loaders.packing import gather_k, perm_from_g_idx, unpack_n, v1_words_to_v2
from loaders.safetensors_io import CheckpointFiles
from loaders.spec import CheckpointSpec, ModuleQuant
from quant_kernels.layout import PackedQuantWeight, pack_factor

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
logger = logging.getLogger(__name__)


def _symmetric_zero_words(bits: int) -> tuple[int, int]:
    """The int32 value every symmetric qzeros word holds in v1 (zero − 1) and in v2 (true zero)."""
    pf = pack_factor(bits)
    v1 = sum((1 << (bits - 1)) - 1 << (bits * i) for i in range(pf))
    v2 = sum((1 << (bits - 1)) << (bits * i) for i in range(pf))
    return tuple(w - 2**32 if w >= 2**31 else w for w in (v1, v2))


MAIN_SUFFIX = "qweight"


def convert(
    files: CheckpointFiles,
    prefix: str,
    quant: ModuleQuant,
    spec: CheckpointSpec,
    expected_kn: tuple[int, int] | None,
) -> PackedQuantWeight:
    """Read ``prefix.{qweight,qzeros,scales,g_idx}`` and return the canonical weight."""
    bits = quant.bits
    pf = pack_factor(bits)
    qweight_name = f"{prefix}.qweight"
    qweight = fetch_words(
        files, qweight_name, f"GPTQ {bits}-bit layer {prefix}", "GPTQ pack_dtype int32"
    )  # int32 [K/pf, N]
    in_features, out_features = qweight.shape[0] * pf, qweight.shape[1]
    check_layer_shape(
        files, qweight_name, (in_features, out_features), expected_kn, f"{bits}-bit GPTQ qweight [K/{pf}, N]"
    )
    group_size, num_groups = effective_group(quant.group_size, in_features)

    scales_name = f"{prefix}.scales"
    scales = fetch_group_scales(
        files, scales_name, f"GPTQ layer {prefix}", num_groups, out_features, quant.group_size
    )  # [ng, N]

    zeros = None
    if not quant.sym:
        qzeros_name = f"{prefix}.qzeros"
        qzeros = fetch(files, qzeros_name, f"asymmetric GPTQ layer {prefix}")  # int32 [ng, N/pf]
        check_dtype(files, qzeros_name, qzeros, (torch.int32,), "GPTQ pack_dtype int32")
        check_shape(files, qzeros_name, qzeros, (num_groups, -(-out_features // pf)), f"[ng, ceil(N/{pf})]")
        if spec.zero_convention == "v1":
            qzeros = v1_words_to_v2(qzeros, bits)
        zeros = unpack_n(qzeros, bits, out_features).to(torch.uint8)  # [ng, N]
    elif f"{prefix}.qzeros" in files:
        # Symmetric weights ignore qzeros; still, words that are neither the v1 nor the v2
        # constant hint at a mislabelled checkpoint (formats.md P1), which the user should know.
        words = files.get(f"{prefix}.qzeros")
        if not any(bool((words == w).all()) for w in _symmetric_zero_words(bits)):
            logger.warning(
                "%s: %s.qzeros are not the symmetric constant although sym=true; qzeros are ignored "
                "(implicit zero %d) — check the checkpoint's sym/checkpoint_format",
                files.file_of[f"{prefix}.qzeros"],
                prefix,
                1 << (bits - 1),
            )

    perm = None
    g_idx_name = f"{prefix}.g_idx"
    if g_idx_name in files:
        g_idx = files.get(g_idx_name)  # int32 [K]
        check_shape(files, g_idx_name, g_idx, (in_features,), "[K]")
        perm = perm_from_g_idx(g_idx, group_size, f"{files.file_of[g_idx_name]}: tensor {g_idx_name!r}")
        if perm is not None:
            qweight = gather_k(qweight, bits, perm)  # rows sorted by group
    return PackedQuantWeight(bits=bits, group_size=group_size, qweight=qweight, scales=scales, zeros=zeros, perm=perm)
