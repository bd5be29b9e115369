"""4-bit copies of an EAGLE head's dense linear layers (``speculative_config`` ``"draft_layers":
"int4"``): each drafting forward reads about a quarter of the layers' fp16 bytes.

Why: at batch 1 a drafting forward is a weight read. The head's layers are dense in the model dtype
(0.55 GB a layer at a 14B model's width), the target's are 4-bit: a head forward of one layer reads
as much as four of the target's layers. The drafts are proposals the target verifies with its own
weights, so a coarser head changes which tokens are proposed (the measured acceptance), never the
outputs.

Knows: ``Linear`` and its methods (the W4A16 one runs the kernels), round-to-nearest packing
(``draft_lm_head.pack_int4_rtn``). Must not know: the head's forward, the proposer, the engine.
"""

from __future__ import annotations

import torch

from qserve.layers.linear import DenseLinearMethod, Linear
from qserve.layers.quant_methods import W4A16LinearMethod
from qserve.spec_decode.draft_lm_head import group_size_for, kernel_dtype, pack_int4_rtn


class DraftInt4LinearMethod(W4A16LinearMethod):
    """W4A16 from a dense weight quantized at load; a float32 head's activations go through the
    kernels in the 16-bit dtype of the copy's scales and come back as float32."""

    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        half = kernel_dtype(layer.quant_prepared[0])
        if x.dtype == half:
            return super().apply(layer, x, bias)
        out = super().apply(layer, x.to(half), None if bias is None else bias.to(half))
        return out.to(x.dtype)


@torch.no_grad()
def quantize_linear(layer: Linear) -> None:
    """Replace ``layer``'s dense weight ``[N, K]`` with a 4-bit asymmetric RTN copy (groups of
    ``group_size_for(K)`` inputs, one packed weight per output shard, fused as a checkpoint's are)."""
    if not isinstance(layer.method, DenseLinearMethod):
        raise ValueError(f"{layer.prefix}: draft_layers 'int4' quantizes dense layers only")
    group_size_for(layer.in_features)  # refuses a width the 4-bit codes cannot pack
    weight = layer.weight.detach()  # [N, K]
    names = [f"{layer.prefix}[{i}]" for i in range(len(layer.output_sizes))]
    method = DraftInt4LinearMethod(names)
    del layer.weight  # (its memory goes once the copies are made)
    layer.method = method
    method.create_weights(layer)
    for shard in range(len(layer.output_sizes)):
        start, size = layer.shard_range(shard)
        method.load_weight(layer, shard, pack_int4_rtn(weight[start : start + size]))
    method.process_after_loading(layer)
