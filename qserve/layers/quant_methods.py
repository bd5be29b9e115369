"""Quantized linear methods: ``W4A16LinearMethod`` and ``make_linear_method``.

Knows: how a (possibly fused) ``Linear`` holds one canonical ``PackedQuantWeight`` per output
shard, fuses shards along N once after loading when they share an act-order permutation (or have
none), and otherwise keeps them apart and concatenates their outputs (act-order permutation
handled per shard); which method a layer gets from the checkpoint's ``CheckpointSpec``. Must not
know: checkpoint formats or files (``loaders`` converted everything already), or kernel internals
(``quant_kernels.ops`` prepares and runs the weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from loaders.spec import CheckpointSpec
from qserve.layers.linear import DenseLinearMethod, Linear, LinearMethod
from quant_kernels import ops
from quant_kernels.layout import PackedQuantWeight


def _fusable(parts: list[PackedQuantWeight]) -> bool:
    first = parts[0]
    for part in parts[1:]:
        if (part.bits, part.group_size, part.scales.dtype) != (first.bits, first.group_size, first.scales.dtype):
            return False
        if (part.perm is None) != (first.perm is None):
            return False
        if part.perm is not None and (part.perm.is_meta or not torch.equal(part.perm, first.perm)):
            return False  # on the meta device (checkpoint checks) perms have no data to compare
    return True


def _fuse(parts: list[PackedQuantWeight]) -> PackedQuantWeight:
    """Concatenate shards along N (qweight, scales, zeros on dim 1); perms must be equal."""
    first = parts[0]
    if len(parts) == 1:
        return first
    zeros = None
    if any(p.zeros is not None for p in parts):
        implicit = 1 << (first.bits - 1)
        zeros = torch.cat(
            [p.zeros if p.zeros is not None else torch.full_like(p.scales, implicit, dtype=torch.uint8) for p in parts],
            dim=1,
        )  # uint8 [ng, N]
    return PackedQuantWeight(
        bits=first.bits,
        group_size=first.group_size,
        qweight=torch.cat([p.qweight for p in parts], dim=1),  # int32 [K/pf, N]
        scales=torch.cat([p.scales for p in parts], dim=1),  # [ng, N]
        zeros=zeros,
        perm=first.perm,
    )


class W4A16LinearMethod(LinearMethod):
    """Weight-only 4/8-bit linear: one ``PackedQuantWeight`` per output shard, fused after loading."""

    def __init__(self, module_names: list[str], bits: list[int] | None = None) -> None:
        self.module_names = list(module_names)  # HF names of the shards, for messages
        self.bits = list(bits) if bits is not None else None

    def create_weights(self, layer: Linear) -> None:
        if len(self.module_names) != len(layer.output_sizes):
            raise ValueError(
                f"{layer.prefix}: {len(self.module_names)} HF module names for {len(layer.output_sizes)} output shards"
            )
        layer.quant_shards = [None] * len(layer.output_sizes)  # list[PackedQuantWeight | None]
        # After process_after_loading: what ops.w4a16_linear consumes, one per fused part. Only
        # these are kept — on CUDA they are the kernels' repacked copy, and holding the
        # canonical weights as well would double the weight memory.
        layer.quant_prepared = []

    def load_weight(self, layer: Linear, shard_id: int, weight: torch.Tensor | PackedQuantWeight) -> None:
        start, size = layer.shard_range(shard_id)
        name = self.module_names[shard_id]
        if not isinstance(weight, PackedQuantWeight):
            raise ValueError(
                f"{name} ({layer.prefix} shard {shard_id}): got a dense tensor {tuple(weight.shape)} for a layer "
                "configured as quantized"
            )
        # A row-parallel act-order shard (qserve.distributed) multiplies a gathered input: its
        # weight has more (padded) rows than the layer has inputs; the layer says how many.
        expected_k = getattr(layer, "weight_in_features", layer.in_features)
        if weight.in_features != expected_k or weight.out_features != size:
            raise ValueError(
                f"{name} ({layer.prefix} shard {shard_id}): packed weight has K={weight.in_features}, "
                f"N={weight.out_features} (qweight {tuple(weight.qweight.shape)}), but the layer expects "
                f"K={expected_k}, N={size}"
            )
        if self.bits is not None and weight.bits != self.bits[shard_id]:
            raise ValueError(
                f"{name}: packed weight has {weight.bits} bits, the checkpoint config says {self.bits[shard_id]}"
            )
        layer.quant_shards[shard_id] = weight

    def process_after_loading(self, layer: Linear) -> None:
        missing = [self.module_names[i] for i, w in enumerate(layer.quant_shards) if w is None]
        if missing:
            raise ValueError(f"{layer.prefix}: quantized shards never loaded: {', '.join(missing)}")
        shards: list[PackedQuantWeight] = list(layer.quant_shards)
        parts = [_fuse(shards)] if _fusable(shards) else shards
        layer.quant_shards = [None] * len(shards)  # release the per-shard copies
        layer.quant_prepared = [ops.prepare_w4a16(p) for p in parts]

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        prepared: list[Any] = layer.quant_prepared
        if len(prepared) == 1:
            return ops.w4a16_linear(x, prepared[0], bias)
        out = torch.cat([ops.w4a16_linear(x, p) for p in prepared], dim=-1)  # [num_tokens, N]
        return out if bias is None else out + bias

    def weight_nbytes(self, layer: Linear) -> int:
        return tensor_nbytes(layer.quant_prepared) + tensor_nbytes(layer.quant_shards)

    def relocate(self, layer: Linear) -> None:
        layer.quant_prepared = clone_tensors(layer.quant_prepared)


def _on_gpu(t: torch.Tensor) -> bool:
    return t.is_cuda


def reference_path_layers(model: torch.nn.Module) -> list[str]:
    """Prefixes of the quantized layers on a GPU that no kernel serves (a card before sm80, no
    Triton, or groups not in steps of 16): their weights stayed canonical and every step dequantizes
    them (``quant_kernels.ops``), so the loader warns about them. Weights on the CPU (the reference
    path is their normal one) or on the meta device (a tensor check) are not named."""
    slow = []
    for module in model.modules():
        parts = getattr(module, "quant_prepared", None) or []
        if any(isinstance(p, PackedQuantWeight) and _on_gpu(p.qweight) for p in parts):
            slow.append(module.prefix)
    return slow


def tensor_nbytes(obj: Any) -> int:
    """Bytes of every tensor reachable through lists and dataclass fields of ``obj``."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(item) for item in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def clone_tensors(obj: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``obj`` with every tensor reachable through lists, tuples and dataclass fields replaced by a fresh
    copy (allocated where the caller's allocator context puts it); a tensor reached twice is copied once."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if id(obj) not in memo:
            memo[id(obj)] = obj.clone()
        return memo[id(obj)]
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tensors(item, memo) for item in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: clone_tensors(getattr(obj, f.name), memo) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **fields)
    return obj


def make_linear_method(spec: CheckpointSpec, hf_module_names: list[str]) -> LinearMethod:
    """The method for a layer made of the given HF modules (several for fused qkv / gate_up)."""
    quants = [spec.module_quant(name) for name in hf_module_names]
    if all(q is None for q in quants):
        return DenseLinearMethod()
    if any(q is None for q in quants):
        detail = ", ".join(f"{n}={'quantized' if q else 'unquantized'}" for n, q in zip(hf_module_names, quants))
        raise ValueError(
            f"Detected some but not all shards of a fused layer are quantized ({detail}; config {spec.source}); "
            "all shards of a fused layer must have the same precision"
        )
    return W4A16LinearMethod(hf_module_names, bits=[q.bits for q in quants])
