"""Baichuan / Baichuan2 (``BaichuanForCausalLM``, remote-code) as the Llama-style decoder.

Knows (families.md (c)): Llama tensor names except the fused ``W_pack`` (q | k | v rows, no
bias), NormHead (lm_head rows L2-normalized: Baichuan2, detected by its 125696-token vocabulary)
and the position-encoding rule: RoPE for hidden_size 4096 (7B), ALiBi otherwise (13B), as vLLM
decides. Both rules can be overridden in config.json with ``qserve_position_embedding``
(``"rope"`` | ``"alibi"``) and ``qserve_norm_head`` (bool). Must not know: tensors or devices.
"""

from __future__ import annotations

import re
from typing import Any

from loaders.renamed import ModuleTarget
from qserve.model.adapter import FamilyAdapter, refuse_unless, require, torch_dtype_name

BAICHUAN2_VOCAB = 125696
_W_PACK = re.compile(r"^(model\.layers\.\d+\.self_attn)\.W_pack$")


def position_embedding(cfg: dict[str, Any]) -> str:
    """The explicit rule: an override key, else RoPE iff hidden_size == 4096 (the 7B models)."""
    override = cfg.get("qserve_position_embedding")
    if override is not None:
        return str(override).lower()
    return "rope" if int(cfg["hidden_size"]) == 4096 else "alibi"


def translate(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    hidden = int(require(cfg, source, "hidden_size"))
    heads = int(require(cfg, source, "num_attention_heads"))
    vocab = int(require(cfg, source, "vocab_size"))
    kind = position_embedding(cfg)
    refuse_unless(kind in ("rope", "alibi"), source, "qserve_position_embedding", kind, "rope, alibi")
    max_positions = int(cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 4096)
    norm_head = cfg.get("qserve_norm_head")
    canonical = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(require(cfg, source, "intermediate_size")),
        "num_hidden_layers": int(require(cfg, source, "num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(cfg.get("rope_theta", 10000.0)),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "eos_token_id": cfg.get("eos_token_id", 2),
        "torch_dtype": torch_dtype_name(cfg),
    }
    behaviours = {
        "alibi": kind == "alibi",
        "lm_head_normalized": bool(vocab == BAICHUAN2_VOCAB if norm_head is None else norm_head),
    }
    return canonical, behaviours


def module_map(prefix: str, cfg: dict[str, Any]) -> list[ModuleTarget] | None:
    match = _W_PACK.match(prefix)
    if match is None:
        return None
    size = cfg["hidden_size"]
    return [
        ModuleTarget(f"{match.group(1)}.q_proj", (0, size)),
        ModuleTarget(f"{match.group(1)}.k_proj", (size, size)),
        ModuleTarget(f"{match.group(1)}.v_proj", (2 * size, size)),
    ]


ADAPTER = FamilyAdapter(
    family="baichuan",
    architectures=("BaichuanForCausalLM",),
    needs=(
        "W_pack split into q/k/v; NormHead (rows normalized at load) for the 125696-token vocabulary; "
        "RoPE if hidden_size == 4096 else ALiBi (override: qserve_position_embedding, qserve_norm_head)"
    ),
    translate=translate,
    module_map=module_map,
)
