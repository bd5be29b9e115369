"""Mixture-of-experts families on the one decoder: Qwen3-MoE, Qwen2-MoE, Mixtral.

Knows (families.md (d)): their config fields (``num_experts`` / ``num_local_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
``mlp_only_layers``, ``shared_expert_intermediate_size``), which layers are sparse (layer ``i``
unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``), that Qwen3-MoE
has Qwen3's q/k norms and Qwen2-MoE Qwen2's q/k/v biases, and Mixtral's names
(``block_sparse_moe`` for ``mlp``; experts ``w1`` = gate, ``w3`` = up, ``w2`` = down; always
renormalized). Must not know: tensors or devices.

The translated config carries ``qserve_moe`` (plain data) so that ``loaders`` can check the
expert tensors' shapes without knowing a family.
"""

from __future__ import annotations

import re
from typing import Any

from loaders.renamed import ModuleTarget
from qserve.model.adapter import FamilyAdapter, refuse_unless, require

QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def _positive(cfg: dict[str, Any], source: str, *keys: str) -> int:
    value = require(cfg, source, *keys)
    refuse_unless(isinstance(value, int) and not isinstance(value, bool) and value > 0, source, keys[0], value,
                  "a positive integer")  # fmt: skip
    return int(value)


def _moe(
    cfg: dict[str, Any],
    source: str,
    *,
    canonical_arch: str,
    num_experts: int,
    inter: int,
    norm: bool,
    layers: list[int],
    names: tuple[str, str, str],
    shared: int = 0,
) -> tuple[dict[str, Any], dict[str, Any]]:
    num_layers = _positive(cfg, source, "num_hidden_layers")
    top_k = _positive(cfg, source, "num_experts_per_tok")
    refuse_unless(top_k <= num_experts, source, "num_experts_per_tok", top_k, f"at most num_experts={num_experts}")
    refuse_unless(cfg.get("hidden_act", "silu") == "silu", source, "hidden_act", cfg.get("hidden_act"), "silu")
    canonical = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    canonical["architectures"] = [canonical_arch]
    if not cfg.get("intermediate_size"):  # no dense layer needs it; the decoder's config requires one
        canonical["intermediate_size"] = inter
    canonical["qserve_moe"] = {
        "num_experts": num_experts,
        "intermediate_size": inter,
        "layers": layers,
        "expert_names": list(names),
        "shared_expert_intermediate_size": shared,
    }
    behaviours = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm,
        "shared_expert_intermediate_size": shared,
        "moe_layers": tuple(layers),
        "moe_expert_names": names,
    }
    assert all(0 <= i < num_layers for i in layers)
    return canonical, behaviours


def _qwen_sparse_layers(cfg: dict[str, Any], source: str, num_experts: int) -> list[int]:
    num_layers = _positive(cfg, source, "num_hidden_layers")
    step = int(cfg.get("decoder_sparse_step") or 1)
    refuse_unless(step >= 1, source, "decoder_sparse_step", step, "a positive integer")
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if num_experts > 0 and i not in dense and (i + 1) % step == 0]


def translate_qwen3_moe(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    num_experts = _positive(cfg, source, "num_experts", "num_local_experts")
    return _moe(
        cfg,
        source,
        canonical_arch="Qwen3ForCausalLM",
        num_experts=num_experts,
        inter=_positive(cfg, source, "moe_intermediate_size"),
        norm=bool(cfg.get("norm_topk_prob", False)),
        layers=_qwen_sparse_layers(cfg, source, num_experts),
        names=QWEN_EXPERT_NAMES,
    )


def translate_qwen2_moe(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    num_experts = _positive(cfg, source, "num_experts", "num_local_experts")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return _moe(
        cfg,
        source,
        canonical_arch="Qwen2ForCausalLM",
        num_experts=num_experts,
        inter=_positive(cfg, source, "moe_intermediate_size"),
        norm=bool(cfg.get("norm_topk_prob", False)),
        layers=_qwen_sparse_layers(cfg, source, num_experts),
        names=QWEN_EXPERT_NAMES,
        shared=shared,
    )


def translate_mixtral(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    num_layers = _positive(cfg, source, "num_hidden_layers")
    return _moe(
        cfg,
        source,
        canonical_arch="MistralForCausalLM",
        num_experts=_positive(cfg, source, "num_local_experts", "num_experts"),
        inter=_positive(cfg, source, "intermediate_size"),
        norm=True,
        layers=list(range(num_layers)),
        names=MIXTRAL_EXPERT_NAMES,
    )


_MIXTRAL_BLOCK = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe(\..+)?$")


def mixtral_module_map(prefix: str, cfg: dict[str, Any]) -> list[ModuleTarget] | None:
    """``block_sparse_moe`` -> ``mlp``; expert names (w1/w2/w3) stay, so that quantization
    configs written against them (AWQ's ``modules_to_not_convert: ["gate"]``) still match."""
    match = _MIXTRAL_BLOCK.match(prefix)
    if match is None:
        return None
    return [ModuleTarget(f"{match.group(1)}.mlp{match.group(2) or ''}")]


QWEN3_MOE_ADAPTER = FamilyAdapter(
    family="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    needs="routed experts (softmax top-k, norm_topk_prob), dense layers by decoder_sparse_step / mlp_only_layers; q/k norms",
    translate=translate_qwen3_moe,
    module_map=None,
)
QWEN2_MOE_ADAPTER = FamilyAdapter(
    family="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    needs="routed experts plus a shared expert behind a sigmoid gate; q/k/v biases",
    translate=translate_qwen2_moe,
    module_map=None,
)
MIXTRAL_ADAPTER = FamilyAdapter(
    family="mixtral",
    architectures=("MixtralForCausalLM",),
    needs="block_sparse_moe as the MLP; experts w1/w3/w2 = gate/up/down; top-k always renormalized",
    translate=translate_mixtral,
    module_map=mixtral_module_map,
)
