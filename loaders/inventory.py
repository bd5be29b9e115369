"""``inventory(path)``: what a checkpoint holds and how many bytes qserve will keep, from headers only.

Knows: how each format's main tensor shape gives a quantized layer's (K, N), and the canonical
layout's sizes (int32 K-packed codes, scales in their stored dtype, uint8 zeros when asymmetric,
int64 act-order permutation). Reads no weight data (only the small ``g_idx`` vectors, to tell a
real act-order permutation from a trivial one). Must not know: the engine or the CLI's output.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaders.detect import detect
from loaders.packing import perm_from_g_idx
from loaders.renamed import CheckpointView
from loaders.safetensors_io import DTYPE_BYTES
from loaders.spec import CheckpointSpec
from loaders.weights import plan_checkpoint, read_config
from quant_kernels.layout import pack_factor

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float": 4, "half": 2}
_PROJ_RE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)$")


@dataclass
class Inventory:
    spec: CheckpointSpec
    config: dict[str, Any]
    quantized_counts: dict[str, int] = field(default_factory=dict)  # projection type -> count
    unquantized_linear_counts: dict[str, int] = field(default_factory=dict)
    act_order_layers: int = 0
    quantized_bytes: int = 0  # canonical packed layout: qweight + scales + zeros + perm
    dense_bytes: int = 0  # everything else, in the model dtype
    checkpoint_bytes: int = 0  # bytes of tensor data on disk

    @property
    def weight_bytes(self) -> int:
        return self.quantized_bytes + self.dense_bytes


def _kind(module: str) -> str:
    match = _PROJ_RE.search(module)
    return match.group(1) if match else module


def _layer_kn(method: str, shape: tuple[int, ...], bits: int) -> tuple[int, int]:
    if method == "awq":
        return shape[0], shape[1] * 8
    if method == "compressed-tensors":
        return shape[1] * pack_factor(bits), shape[0]
    return shape[0] * pack_factor(bits), shape[1]


def inventory(path: str | Path, spec: CheckpointSpec | None = None, view: CheckpointView | None = None) -> Inventory:
    spec = spec or detect(path)
    config = view.config if view is not None else read_config(path)
    plan = plan_checkpoint(path, spec, view)
    files = plan.files
    model_dtype = str(spec.model_dtype or "float16")
    dense_elem = _DTYPE_BYTES.get(model_dtype, 2)
    inv = Inventory(spec=spec, config=config)
    inv.checkpoint_bytes = sum(info.nbytes for info in files.infos.values())
    for module, main in plan.quantized.items():
        quant = spec.module_quant(module)
        assert quant is not None
        num_rows, num_cols = _layer_kn(spec.method, files.infos[main].shape, quant.bits)
        geff = num_rows if quant.group_size == -1 else quant.group_size
        num_groups = math.ceil(num_rows / geff)
        scale_name = f"{module}.weight_scale" if spec.method == "compressed-tensors" else f"{module}.scales"
        scale_bytes = DTYPE_BYTES[files.info(scale_name).dtype]
        nbytes = num_rows // pack_factor(quant.bits) * num_cols * 4 + num_groups * num_cols * scale_bytes
        if not quant.sym:
            nbytes += num_groups * num_cols  # uint8 zeros
        g_idx_name = next((n for n in (f"{module}.g_idx", f"{module}.weight_g_idx") if n in files), None)
        if g_idx_name is not None and perm_from_g_idx(files.get(g_idx_name), geff, g_idx_name) is not None:
            nbytes += num_rows * 8  # int64 perm
            inv.act_order_layers += 1
        inv.quantized_bytes += nbytes
        kind = _kind(module)
        inv.quantized_counts[kind] = inv.quantized_counts.get(kind, 0) + 1
    for name, info in files.infos.items():
        if name in plan.consumed:
            continue
        elem = dense_elem if info.dtype in ("F16", "BF16", "F32", "F64") else DTYPE_BYTES[info.dtype]
        inv.dense_bytes += math.prod(info.shape) * elem
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and (module in plan.expected):
            kind = _kind(module)
            inv.unquantized_linear_counts[kind] = inv.unquantized_linear_counts.get(kind, 0) + 1
    files.close()
    return inv
