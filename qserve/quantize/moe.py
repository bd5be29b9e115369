"""Quantizing mixture-of-experts layers: the calibration view of a sparse layer, and GPTQ per expert.

Knows: a sparse decoder layer of the MoE families (attention as ``DenseDecoderLayer``; the
MLP = router ``mlp.gate`` [E, H] kept 16-bit, softmax top-k routing with optional
renormalization, SwiGLU experts ``mlp.experts.N.{gate,up,down}_proj``, Qwen2-MoE's
``shared_expert`` behind the sigmoid ``shared_expert_gate``; Mixtral's ``block_sparse_moe`` with
experts ``w1``/``w3``/``w2`` = gate/up/down — inside, every expert linear has the short name
``experts__N__{gate,up,down}_proj`` whatever the family calls it), and how GPTQ reaches each expert:
one calibration pass collects every expert's Hessian from the tokens the router actually sends
it (true-sequential: all gate/up first, then all down on inputs through the quantized gate/up).

The fallback (documented in README): an expert that received fewer than ``min_tokens``
calibration tokens (default: its input width / 8, at least 16) has no Hessian worth trusting, so
it is quantized round-to-nearest on the same grid (group size, symmetry) instead; the report
lists how many experts took it. Must not know: checkpoint files, formats or the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qserve.config import ModelConfig
from qserve.layers.rotary import RotaryEmbedding
from qserve.quantize.gptq import SEQUENTIAL_GROUPS, GPTQSettings, HessianAccumulator, gptq_quantize_weight
from qserve.quantize.layer import LINEARS, DenseDecoderLayer
from qserve.quantize.quantizer import QuantizedLinear
from qserve.quantize.rtn import RTNSettings, quantize_weight_rtn
from quant_kernels.moe_reference import select_experts

logger = logging.getLogger(__name__)

SHARED_GATE = "mlp.shared_expert_gate.weight"
ROLES = ("gate_proj", "up_proj", "down_proj")  # the short names' roles, in ModelConfig.moe_expert_names order


def block_name(config: ModelConfig) -> str:
    """The sparse MLP's module name in the checkpoint (relative to the layer)."""
    return "block_sparse_moe" if config.family == "mixtral" else "mlp"


def router_name(config: ModelConfig) -> str:
    return f"{block_name(config)}.gate.weight"


def sparse_linear_names(config: ModelConfig) -> dict[str, str]:
    """Short name -> HF name (relative to the layer) of a sparse layer's Linears, forward order."""
    names = {short: hf for short, hf in LINEARS.items() if hf.startswith("self_attn.")}
    block = block_name(config)
    for e in range(config.num_experts):
        for role, proj in zip(ROLES, config.moe_expert_names):
            names[f"experts__{e}__{role}"] = f"{block}.experts.{e}.{proj}"
    if config.shared_expert_intermediate_size:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names[f"shared__{proj}"] = f"mlp.shared_expert.{proj}"
    return names


class SparseDecoderLayer(DenseDecoderLayer):
    """One sparse (MoE) decoder layer built from its checkpoint tensors, for calibration."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        rotary: RotaryEmbedding,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.router = router_name(config)
        plain = (self.router, SHARED_GATE) if config.shared_expert_intermediate_size else (self.router,)
        super().__init__(config, tensors, rotary, device, dtype, sparse_linear_names(config), plain)

    def gate_readers(self) -> list[torch.Tensor]:
        """The 16-bit tensors that read the MLP's normed input besides the experts: the router
        (and Qwen2-MoE's shared-expert gate), each ``[rows, hidden]``."""
        return [tensor for name, tensor in self.plain.items() if name in (self.router, SHARED_GATE)]

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Routed experts (+ shared expert) of normed ``x: [B, T, hidden]`` -> ``[B, T, hidden]``."""
        cfg = self.config
        flat = x.reshape(-1, x.shape[-1])  # [n, H]
        weights, ids = select_experts(
            F.linear(flat, self.plain[self.router]), cfg.num_experts_per_tok, cfg.norm_topk_prob
        )
        out = torch.zeros_like(flat)
        for e in range(cfg.num_experts):
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            if tokens.numel() == 0:
                continue
            xe = flat[tokens]  # [c, H]
            act = F.silu(self.linears[f"experts__{e}__gate_proj"](xe)) * self.linears[f"experts__{e}__up_proj"](xe)
            y = self.linears[f"experts__{e}__down_proj"](act) * weights[tokens, slots, None].to(flat.dtype)
            out.index_add_(0, tokens, y)
        if cfg.shared_expert_intermediate_size:
            shared = F.silu(self.linears["shared__gate_proj"](flat)) * self.linears["shared__up_proj"](flat)
            gate = torch.sigmoid(F.linear(flat, self.plain[SHARED_GATE]))  # [n, 1]
            out = out + gate * self.linears["shared__down_proj"](shared)
        return out.view_as(x)


@dataclass
class MoEQuantReport:
    experts: int = 0
    # HF names (relative to the layer's prefix, made absolute by the pipeline) of the expert
    # linears that took the starved-expert fallback: GPTQ's round-to-nearest, AWQ's unscaled down_proj
    rtn_fallback: list[str] = field(default_factory=list)


def _collect(
    layer: SparseDecoderLayer, names: list[str], hidden: torch.Tensor, batch_size: int
) -> dict[str, HessianAccumulator]:
    """One pass over the calibration windows; the Hessian of every Linear in ``names`` from the
    inputs it actually receives (an expert: only its routed tokens)."""
    accs = {
        name: HessianAccumulator(layer.linear(name).in_features, layer.linear(name).weight.device) for name in names
    }
    handles = [
        layer.linear(name).register_forward_pre_hook(lambda _m, args, acc=accs[name]: acc.add(args[0]))
        for name in names
    ]
    try:
        layer.run(hidden, batch_size)
    finally:
        for handle in handles:
            handle.remove()
    return accs


def default_min_tokens(in_features: int) -> int:
    return max(16, in_features // 8)


@torch.no_grad()
def quantize_layer_gptq_moe(
    layer: SparseDecoderLayer,
    hidden: torch.Tensor,  # [S, T, hidden]
    settings: GPTQSettings,
    batch_size: int,
    report: MoEQuantReport,
    min_tokens: int | None = None,
) -> dict[str, QuantizedLinear]:
    """True-sequential GPTQ of a sparse layer: q/k/v, o (as dense layers), then every expert's
    gate/up (and the shared expert's), then every down, with the RTN fallback for starved experts."""
    results: dict[str, QuantizedLinear] = {}
    rtn = RTNSettings(settings.bits, settings.group_size, settings.sym)
    mlp_names = [n for n in layer.linear_names if n not in LINEARS]
    stages = [list(g) for g in SEQUENTIAL_GROUPS[:2]]  # attention groups share one input each
    stages += [[n for n in mlp_names if not n.endswith("down_proj")], [n for n in mlp_names if n.endswith("down_proj")]]
    for stage in stages:
        shared_input = stage[0] in LINEARS  # q/k/v share one input: one Hessian
        accs = _collect(layer, stage[:1] if shared_input else stage, hidden, batch_size)
        for name in stage:
            linear = layer.linear(name)
            acc = accs[stage[0]] if shared_input else accs[name]
            needed = default_min_tokens(linear.in_features) if min_tokens is None else min_tokens
            is_expert = name.startswith("experts__")
            if is_expert and acc.num_tokens < needed:
                result = quantize_weight_rtn(linear.weight, rtn)
                report.rtn_fallback.append(layer.linear_names[name])
            else:
                result = gptq_quantize_weight(linear.weight, acc.hessian, settings, linear.bias)
            report.experts += is_expert and name.endswith("down_proj")
            linear.weight.copy_(result.weight().to(linear.weight.dtype))
            results[name] = result
        del accs
    return results
