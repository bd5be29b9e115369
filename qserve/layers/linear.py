"""Linear layers with a pluggable ``LinearMethod`` (dense here; W4A16 in ``quant_methods``).

Knows: how a (possibly fused) linear layer holds its output shards and delegates storage and
math to its method. Must not know: checkpoint formats or file names; the model's weight router
hands it ready tensors (dense ``[N_shard, K]`` in torch orientation) or ``PackedQuantWeight``.

A fused layer (qkv, gate_up) has several output shards concatenated along N, in the order of
``output_sizes``; ``shard_id`` indexes that list.

LoRA (``qserve.lora``): a layer may hold adapter slots (``lora``, set by ``LoRAManager``); a forward
given the step's ``LoRAIndices`` adds each row's adapter to the base output. Without indices (LoRA
off, or no row of the step uses an adapter) the forward is the base layer's alone. Indices with a side
stream (``QSERVE_LORA_OVERLAP``) launch the adapter's shrink before the base GEMM, beside it.
``forward_unexpanded`` stops short of the expand: the base output and the pending shrink, for a consumer
that fuses the expand into its own launch (the MLP's SiLU-and-mul).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from quant_kernels import lora_ops
from quant_kernels.layout import PackedQuantWeight


class LinearMethod(ABC):
    """How a linear layer stores its weight and computes ``x @ W``."""

    @abstractmethod
    def create_weights(self, layer: Linear) -> None:
        """Register the layer's parameters/buffers (empty until loaded)."""

    @abstractmethod
    def load_weight(self, layer: Linear, shard_id: int, weight: torch.Tensor | PackedQuantWeight) -> None:
        """Take one output shard's weight as the loader produced it."""

    def process_after_loading(self, layer: Linear) -> None:
        """One-time work after every shard arrived (fusing, repacking for kernels)."""
        return None  # dense weights need none

    def relocate(self, layer: Linear) -> None:
        """Copy what ``process_after_loading`` made into fresh memory (the loader's weights pool, issue 25);
        dense weights were allocated when the layer was built and stay."""
        return None

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [num_tokens, K] -> [num_tokens, N]``, plus ``bias [N]`` when given (methods fuse
        it into the matmul's epilogue: one kernel fewer per layer)."""

    def weight_nbytes(self, layer: Linear) -> int:
        """Bytes of weight this method holds for the layer (bias excluded)."""
        return sum(p.numel() * p.element_size() for name, p in layer.named_parameters() if name != "bias")


class DenseLinearMethod(LinearMethod):
    """Unquantized weights in the model dtype."""

    def create_weights(self, layer: Linear) -> None:
        weight = torch.empty(sum(layer.output_sizes), layer.in_features, dtype=layer.params_dtype)  # [N, K]
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def load_weight(self, layer: Linear, shard_id: int, weight: torch.Tensor | PackedQuantWeight) -> None:
        if isinstance(weight, PackedQuantWeight):
            raise ValueError(f"{layer.prefix}: got a quantized weight for a layer configured as unquantized")
        start, size = layer.shard_range(shard_id)
        expected = (size, layer.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(
                f"{layer.prefix} shard {shard_id}: weight shape {tuple(weight.shape)}, expected {expected}"
            )
        layer.weight.data[start : start + size].copy_(weight)

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class Linear(nn.Module):
    """``y = x @ W + b`` with ``W`` made of one or more output shards."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        bias: bool,
        params_dtype: torch.dtype,
        method: LinearMethod,
        prefix: str,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.out_features = sum(output_sizes)
        self.params_dtype = params_dtype
        self.method = method
        self.prefix = prefix
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=params_dtype), requires_grad=False)
        else:
            self.bias = None
        self.lora = None  # qserve.lora.slots.LoRALayerWeights when LoRA is enabled
        method.create_weights(self)

    def shard_range(self, shard_id: int) -> tuple[int, int]:
        """(start, size) of an output shard along N."""
        if not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard {shard_id} out of range for {len(self.output_sizes)} shards")
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]

    def load_weight(self, shard_id: int, weight: torch.Tensor | PackedQuantWeight) -> None:
        self.method.load_weight(self, shard_id, weight)

    def load_bias(self, shard_id: int, bias: torch.Tensor) -> None:
        if self.bias is None:
            raise ValueError(f"{self.prefix}: checkpoint has a bias but the config says the layer has none")
        start, size = self.shard_range(shard_id)
        if tuple(bias.shape) != (size,):
            raise ValueError(f"{self.prefix} shard {shard_id}: bias shape {tuple(bias.shape)}, expected ({size},)")
        self.bias.data[start : start + size].copy_(bias)

    def process_after_loading(self) -> None:
        self.method.process_after_loading(self)

    def relocate(self) -> None:
        self.method.relocate(self)

    # LoRA under tensor parallelism: an adapter is read for the whole (unsplit) layer, then cut to the
    # part this layer holds. A single-process layer is whole: both are identities here.
    def lora_full_sizes(self) -> tuple[int, list[int]]:
        """``(K, output sizes)`` of the whole layer: the shapes an adapter's matrices are checked against."""
        return self.in_features, list(self.output_sizes)

    def shard_lora(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An adapter's slot matrices for the whole layer (``a`` ``[S * R, K]``, ``b`` ``[N, R]``) ->
        the part this layer's slots hold."""
        return a, b

    def forward(
        self, x: torch.Tensor, lora: lora_ops.LoRAIndices | None = None
    ) -> torch.Tensor:  # [num_tokens, K] -> [num_tokens, N]
        w = self.lora
        if lora is not None and w is not None and lora.overlap is not None:
            # QSERVE_LORA_OVERLAP: the shrink (it reads x only) runs beside the base GEMM on a side stream
            y, pending = self.forward_unexpanded(x, lora)
            return lora_ops.finish_lora(y, pending, w.b, w.slice_starts, lora)
        y = self.method.apply(self, x, self.bias)
        if lora is not None and w is not None:
            y = lora_ops.add_lora(y, x, w.a, w.b, w.slice_starts, lora)
        return y

    def forward_unexpanded(
        self, x: torch.Tensor, lora: lora_ops.LoRAIndices | None
    ) -> tuple[torch.Tensor, lora_ops.PendingLoRA | None]:  # [num_tokens, K] -> ([num_tokens, N], pending)
        """The base output and, where this layer holds adapters and the step uses them, the adapter's
        shrink launched (``lora_ops.begin_lora``: beside the GEMM under ``QSERVE_LORA_OVERLAP``), its
        expand left to the caller (``lora_ops.finish_lora`` or a consumer that fuses it); else None."""
        w = self.lora
        pending = None if lora is None or w is None else lora_ops.begin_lora(x, w.a, w.b, w.slice_starts, lora)
        return self.method.apply(self, x, self.bias), pending
