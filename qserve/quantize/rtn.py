"""Round-to-nearest (RTN): the calibration-free baseline quantizer.

Knows: per-group min/max scales and zero points (GPTQ convention, formats.md §2.3) applied to
every Linear of a decoder layer without looking at any activations. Must not know: checkpoint
files or formats, the serving engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qserve.quantize.layer import DenseDecoderLayer
from qserve.quantize.quantizer import QuantizedLinear, quantize_rtn


@dataclass(frozen=True, slots=True)
class RTNSettings:
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    min_zero: int = 1  # asym zeros >= 1, so the GPTQ v1 layout stores them exactly


@torch.no_grad()
def quantize_weight_rtn(
    weight: torch.Tensor, settings: RTNSettings, bias: torch.Tensor | None = None
) -> QuantizedLinear:
    """RTN of ``weight: [N, K]``."""
    return quantize_rtn(weight, settings.bits, settings.group_size, settings.sym, min_zero=settings.min_zero, bias=bias)


@torch.no_grad()
def quantize_layer_rtn(layer: DenseDecoderLayer, settings: RTNSettings) -> dict[str, QuantizedLinear]:
    results: dict[str, QuantizedLinear] = {}
    for name in layer.linear_names:
        linear = layer.linear(name)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        results[name] = quantize_weight_rtn(linear.weight, settings, bias)
        linear.weight.copy_(results[name].weight().to(linear.weight.dtype))
    return results
