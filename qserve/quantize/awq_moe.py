"""AWQ for mixture-of-experts layers: one shared gate/up scale, one down scale per expert.

Knows: where AWQ's per-input-channel scales can be folded in a sparse layer (``moe``'s
``SparseDecoderLayer``) and from which tokens each is searched:

* attention: as dense AWQ (``awq.scale_attention``);
* every expert's gate/up (and Qwen2-MoE's shared expert's) read the one ``post_attention_layernorm``
  output, so they share ONE scale ``s`` folded into that norm, as AutoAWQ's MoE models do. The
  router and the shared-expert gate read that norm too: they stay 16-bit and get ``s`` multiplied
  into their columns, so routing is unchanged (an exact re-parametrisation; AutoAWQ leaves the
  router out and changes its logits). ``s`` is searched on the whole sparse block's output, each
  expert run on the tokens the router sends it, from ``mean |x|`` over all tokens (every token
  reaches exactly ``k`` experts, so this is also the routed-token-weighted mean of the experts');
* each expert's down reads only its own ``silu(gate) * up``: its scale is searched on the inputs
  of the tokens routed to THAT expert and folded into its up_proj rows (the shared expert's down
  likewise, on every token).

The starved-expert fallback, the policy of GPTQ's MoE path (``moe``): an expert that receives
fewer than ``min_tokens`` calibration tokens (default ``moe.default_min_tokens(moe_intermediate)``
= max(16, I/8)) gets no down scale of its own (``s = 1``: plain AutoAWQ min-max quantization of
its down_proj), and its down_proj is listed in the report. Its gate/up carry the layer's shared
scale like every expert's (the norm is shared; there is nothing else to fall back to). The final
quantization is AutoAWQ's asymmetric min-max on the scaled weights for every Linear. Must not
know: checkpoint files or formats, the serving engine.
"""

from __future__ import annotations

import statistics

import torch

from qserve.quantize.awq import (
    AWQSettings,
    Swap,
    fold_into_linear,
    fold_into_norm,
    quantize_folded,
    scale_attention,
    search_scales,
)
from qserve.quantize.moe import MoEQuantReport, SparseDecoderLayer, default_min_tokens
from qserve.quantize.quantizer import QuantizedLinear


def _expert(e: int, role: str) -> str:
    return f"experts__{e}__{role}"


def capture_down_inputs(layer: SparseDecoderLayer, x: torch.Tensor, batch_size: int) -> dict[str, torch.Tensor]:
    """Run the sparse block on its normed input ``x [S, T, H]``; every down_proj's inputs
    ``[tokens it received, I]`` by short name (an expert that received none: ``[0, I]``)."""
    downs = [n for n in layer.linear_names if n.endswith("down_proj")]
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in downs}
    handles = [
        layer.linear(n).register_forward_pre_hook(
            lambda _m, args, out=parts[n]: out.append(args[0].reshape(-1, args[0].shape[-1]).clone())
        )
        for n in downs
    ]
    try:
        for start in range(0, x.shape[0], batch_size):
            layer.mlp(x[start : start + batch_size])
    finally:
        for handle in handles:
            handle.remove()
    return {n: torch.cat(p) if p else x.new_zeros(0, layer.linear(n).in_features) for n, p in parts.items()}


@torch.no_grad()
def quantize_layer_awq_moe(
    layer: SparseDecoderLayer,
    hidden: torch.Tensor,  # [S, T, hidden]
    settings: AWQSettings,
    batch_size: int,
    report: MoEQuantReport,
    min_tokens: int | None = None,
) -> tuple[dict[str, QuantizedLinear], dict[str, float]]:
    """Scale-search, fold and quantize one sparse layer (see the module docstring); returns
    (quantized linears by short name, alphas: qkv, o, gate_up and the mean of the experts' down)."""
    cfg = layer.config
    lin = layer.linear
    alphas: dict[str, float] = {}
    scale_attention(layer, hidden, settings, batch_size, alphas)

    # gate/up of every expert and of the shared expert: one scale, folded into the norm.
    x = layer.capture_mlp_input(hidden, batch_size)  # [S, T, H]
    gate_up = tuple(
        n for n in layer.linear_names if n.startswith(("experts__", "shared__")) and not n.endswith("down_proj")
    )
    s, alphas["gate_up"], _ = search_scales(
        x, [lin(n).weight for n in gate_up], Swap(layer, gate_up)(layer.mlp), settings, batch_size
    )
    fold_into_norm(layer.norm("post_attention_layernorm"), s, [lin(n).weight for n in gate_up] + layer.gate_readers())
    x.div_(s.to(x.dtype))  # the block's input after the fold: what the norm now outputs

    # down of each expert, on the tokens routed to it; the shared expert's on every token.
    inputs = capture_down_inputs(layer, x, batch_size)
    del x
    down_alphas: list[float] = []
    for e in range(cfg.num_experts):
        down = _expert(e, "down_proj")
        xe = inputs.pop(down)  # [c, I]
        needed = default_min_tokens(lin(down).in_features) if min_tokens is None else min_tokens
        report.experts += 1
        if xe.shape[0] < needed:
            report.rtn_fallback.append(layer.linear_names[down])
            continue
        s, alpha, _ = search_scales(xe[None], [lin(down).weight], Swap(layer, (down,))(lin(down)), settings, 1)
        fold_into_linear(lin(_expert(e, "up_proj")), s, lin(down))
        down_alphas.append(alpha)
    if "shared__down_proj" in inputs:
        xs = inputs.pop("shared__down_proj")  # [S*T, I_shared]
        s, alphas["shared_down"], _ = search_scales(
            xs[None], [lin("shared__down_proj").weight], Swap(layer, ("shared__down_proj",))(lin("shared__down_proj")),
            settings, 1,
        )  # fmt: skip
        fold_into_linear(lin("shared__up_proj"), s, lin("shared__down_proj"))
    alphas["down"] = statistics.fmean(down_alphas) if down_alphas else float("nan")
    return quantize_folded(layer, list(layer.linear_names), settings), alphas
