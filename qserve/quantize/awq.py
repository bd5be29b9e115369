"""AWQ: activation-aware weight quantization (Lin et al. 2023, as in AutoAWQ).

Knows: which Linears of a Llama-family decoder layer share an input and which op precedes them
(q/k/v after ``input_layernorm``; gate/up after ``post_attention_layernorm``; down after
``up_proj``; o after ``v_proj`` only when v's outputs match o's inputs, i.e. no GQA), the
per-input-channel scale search ``s = mean|x|^α`` over a grid of α in [0, 1) that minimises the
output error of the block with its weights quantized, folding ``1/s`` into the preceding norm
weight or Linear rows (an exact re-parametrisation in full precision), and the final asymmetric
group quantization with zero points. The attention half, the folds and the final quantization
are shared with mixture-of-experts layers (``awq_moe``). Must not know: checkpoint files or
formats, tokenizers, the serving engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from qserve.quantize.layer import DenseDecoderLayer, RMSNorm
from qserve.quantize.quantizer import QuantizedLinear, pseudo_quantize, quantize_rtn

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class AWQSettings:
    bits: int = 4
    group_size: int = 128
    n_grid: int = 20


@torch.no_grad()
def search_scales(
    x: torch.Tensor,  # [S, T, K] input shared by ``weights``
    weights: list[torch.Tensor],  # each [N_i, K]
    block: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor],  # (x, weights) -> block output
    settings: AWQSettings,
    batch_size: int,
) -> tuple[torch.Tensor, float, float]:
    """Best per-input-channel scales ``s [K]``; returns (s, best alpha, its error).

    ``block(x, ws)`` computes the block's output with the given weights in place of ``weights``.
    The error is the mean squared difference to the block's full-precision output.
    """
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)  # [K]
    reference = [block(x[i : i + batch_size], weights) for i in range(0, x.shape[0], batch_size)]
    best = (torch.ones_like(x_mean), -1.0, float("inf"))
    for step in range(settings.n_grid):
        alpha = step / settings.n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        trial = [(pseudo_quantize(w.float() * s, settings.bits, settings.group_size) / s).to(w.dtype) for w in weights]
        err = 0.0
        for ref, i in zip(reference, range(0, x.shape[0], batch_size)):
            err += float((block(x[i : i + batch_size], trial) - ref).float().pow(2).sum())
        err /= sum(r.numel() for r in reference)
        if err < best[2]:
            best = (s, alpha, err)
    return best


class Swap:
    """Temporarily replace some Linears' weights (for evaluating a block with trial weights)."""

    def __init__(self, layer: DenseDecoderLayer, names: tuple[str, ...]) -> None:
        self.layer, self.names = layer, names

    def __call__(
        self, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]:
        def block(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
            linears = [self.layer.linear(n) for n in self.names]
            saved = [lin.weight.data for lin in linears]
            try:
                for lin, w in zip(linears, weights):
                    lin.weight.data = w
                return fn(x)
            finally:
                for lin, w in zip(linears, saved):
                    lin.weight.data = w

        return block


def capture(layer: DenseDecoderLayer, name: str, hidden: torch.Tensor, batch_size: int) -> torch.Tensor:
    parts: list[torch.Tensor] = []
    layer.feed_input_of(name, hidden, batch_size, lambda x: parts.append(x.detach().clone()))
    return torch.cat(parts)  # [S, T, K]


def fold_into_norm(norm: RMSNorm, s: torch.Tensor, consumers: list[torch.Tensor]) -> None:
    """``norm``'s output divided by ``s [K]``, every consumer's input columns multiplied by it:
    the function is unchanged (every reader of the norm must be among ``consumers``)."""
    norm.weight.div_(s.to(norm.weight.dtype))
    for weight in consumers:  # [N_i, K]
        weight.mul_(s.to(weight.dtype))


def fold_into_linear(prev: nn.Linear, s: torch.Tensor, nxt: nn.Linear) -> None:
    """``prev``'s output rows (and bias) divided by ``s [K]``, ``nxt``'s input columns multiplied:
    exact when ``nxt`` reads ``prev``'s outputs one to one (through an elementwise product)."""
    prev.weight.div_(s.view(-1, 1).to(prev.weight.dtype))
    if prev.bias is not None:
        prev.bias.div_(s.to(prev.bias.dtype))
    nxt.weight.mul_(s.to(nxt.weight.dtype))


@torch.no_grad()
def scale_attention(
    layer: DenseDecoderLayer, hidden: torch.Tensor, settings: AWQSettings, batch_size: int, alphas: dict[str, float]
) -> None:
    """Search and fold the attention scales of one layer (q/k/v after ``input_layernorm``; o
    after v without GQA); the chosen alphas go into ``alphas``."""
    lin = layer.linear
    # q/k/v after input_layernorm, judged on the attention block's output.
    x = capture(layer, "q_proj", hidden, batch_size)
    names = ("q_proj", "k_proj", "v_proj")
    s, alphas["qkv"], _ = search_scales(
        x, [lin(n).weight for n in names], Swap(layer, names)(layer.attention), settings, batch_size
    )
    fold_into_norm(layer.norm("input_layernorm"), s, [lin(n).weight for n in names])
    del x

    # o after v, only when v's outputs are o's inputs one to one (no grouped-query attention).
    if lin("v_proj").out_features == lin("o_proj").in_features:
        x = capture(layer, "o_proj", hidden, batch_size)
        s, alphas["o"], _ = search_scales(
            x, [lin("o_proj").weight], Swap(layer, ("o_proj",))(lin("o_proj")), settings, batch_size
        )
        fold_into_linear(lin("v_proj"), s, lin("o_proj"))
        del x


@torch.no_grad()
def quantize_folded(
    layer: DenseDecoderLayer, names: list[str] | tuple[str, ...], settings: AWQSettings
) -> dict[str, QuantizedLinear]:
    """The final asymmetric (AutoAWQ min-max) group quantization of the scaled Linears ``names``;
    each Linear then holds its dequantized weight, for the next layer's calibration inputs."""
    results: dict[str, QuantizedLinear] = {}
    for name in names:
        linear = layer.linear(name)
        result = quantize_rtn(
            linear.weight,
            settings.bits,
            settings.group_size,
            sym=False,
            style="awq",
            bias=None if linear.bias is None else linear.bias.detach().clone(),
        )
        linear.weight.copy_(result.weight().to(linear.weight.dtype))
        results[name] = result
    return results


@torch.no_grad()
def quantize_layer_awq(
    layer: DenseDecoderLayer, hidden: torch.Tensor, settings: AWQSettings, batch_size: int
) -> tuple[dict[str, QuantizedLinear], dict[str, float]]:
    """Scale-search, fold and quantize one decoder layer; returns (quantized linears, alphas)."""
    alphas: dict[str, float] = {}
    lin = layer.linear
    scale_attention(layer, hidden, settings, batch_size, alphas)

    # gate/up after post_attention_layernorm, judged on the MLP's output.
    x = capture(layer, "gate_proj", hidden, batch_size)
    names = ("gate_proj", "up_proj")
    s, alphas["gate_up"], _ = search_scales(
        x, [lin(n).weight for n in names], Swap(layer, names)(layer.mlp), settings, batch_size
    )
    fold_into_norm(layer.norm("post_attention_layernorm"), s, [lin(n).weight for n in names])
    del x

    # down after up (scale folded into up_proj's rows).
    x = capture(layer, "down_proj", hidden, batch_size)
    s, alphas["down"], _ = search_scales(
        x, [lin("down_proj").weight], Swap(layer, ("down_proj",))(lin("down_proj")), settings, batch_size
    )
    fold_into_linear(lin("up_proj"), s, lin("down_proj"))
    del x
    return quantize_folded(layer, QUANTIZED, settings), alphas
