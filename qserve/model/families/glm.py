"""Native transformers GLM: ``GlmForCausalLM`` (glm-4-9b-*-hf) and ``Glm4ForCausalLM`` (GLM-4-0414).

Knows: both are Llama-named with q/k/v biases (no o_proj bias), a fused ``mlp.gate_up_proj``
(gate | up rows), rotary on ``partial_rotary_factor`` (default 0.5) of each head as interleaved
pairs; ``Glm4ForCausalLM`` adds sandwich norms (``post_self_attn_layernorm``,
``post_mlp_layernorm``). Must not know: tensors or devices.
"""

from __future__ import annotations

import re
from typing import Any

from loaders.renamed import ModuleTarget
from qserve.model.adapter import FamilyAdapter, require

_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp)\.gate_up_proj$")


def _partial_factor(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))


def translate(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    hidden = int(require(cfg, source, "hidden_size"))
    heads = int(require(cfg, source, "num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    canonical = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    canonical.update(
        architectures=["LlamaForCausalLM"],
        head_dim=head_dim,
        attention_bias=bool(cfg.get("attention_bias", True)),
        o_bias=False,
    )
    behaviours = {"rotary_dim": int(head_dim * _partial_factor(cfg)), "rope_interleaved": True}
    return canonical, behaviours


def translate_glm4(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    canonical, behaviours = translate(cfg, source)
    return canonical, {**behaviours, "sandwich_norms": True}


def module_map(prefix: str, cfg: dict[str, Any]) -> list[ModuleTarget] | None:
    match = _GATE_UP.match(prefix)
    if match is None:
        return None
    size = cfg["intermediate_size"]
    return [
        ModuleTarget(f"{match.group(1)}.gate_proj", (0, size)),
        ModuleTarget(f"{match.group(1)}.up_proj", (size, size)),
    ]


GLM_ADAPTER = FamilyAdapter(
    family="glm",
    architectures=("GlmForCausalLM",),
    needs="q/k/v biases, fused gate_up_proj split; rotary on half of each head as interleaved pairs",
    translate=translate,
    module_map=module_map,
)
GLM4_ADAPTER = FamilyAdapter(
    family="glm4",
    architectures=("Glm4ForCausalLM",),
    needs="as GlmForCausalLM plus sandwich norms (post_self_attn_layernorm, post_mlp_layernorm)",
    translate=translate_glm4,
    module_map=module_map,
)
