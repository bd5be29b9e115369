"""Qwen v1 (``QWenLMHeadModel``, remote-code ``qwen`` format) as the Llama-style decoder.

Knows (families.md (a)): the config fields and their Aug-2023 aliases, that ``intermediate_size``
is twice the real MLP width, the tensor names (fused ``c_attn`` with bias = q | k | v rows;
``w2`` is the SiLU gate and ``w1`` the up projection), and the declared behaviours: partial
rotary over ``kv_channels * rotary_pct`` dims, dynamic NTK fixed per sequence at prefill and logn
query scaling beyond ``seq_length``. The GPTQ Int4 release layout needs nothing extra here: its
zero biases on quantized layers are skipped by the decoder, its fused ``c_attn`` is split by the
loader's renamed view. Must not know: tensors or devices.
"""

from __future__ import annotations

import re
from typing import Any

from loaders.renamed import ModuleTarget
from qserve.model.adapter import FamilyAdapter, refuse_unless, require, torch_dtype_name

# Qwen's tokenizer gives these fixed ids (tokenization_qwen.py); its chat format stops on all three.
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 151643, 151644, 151645

_LAYER = re.compile(r"^transformer\.h\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.w2": "mlp.gate_proj",  # the SiLU branch
    "mlp.w1": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}


def translate(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    hidden = int(require(cfg, source, "hidden_size", "n_embd"))
    heads = int(require(cfg, source, "num_attention_heads", "n_head"))
    layers = int(require(cfg, source, "num_hidden_layers", "n_layer"))
    ffn = int(require(cfg, source, "intermediate_size", "ffn_hidden_size"))
    head_dim = int(cfg.get("kv_channels") or hidden // heads)
    refuse_unless(ffn % 2 == 0, source, "intermediate_size", ffn, "an even number (twice the MLP width)")
    refuse_unless(cfg.get("no_bias", True), source, "no_bias", cfg.get("no_bias"), "true (biases on c_attn only)")
    rotary_dim = int(head_dim * float(cfg.get("rotary_pct", 1.0)))
    refuse_unless(rotary_dim % 2 == 0 and rotary_dim > 2, source, "rotary_pct", cfg.get("rotary_pct"), "an even dim")
    seq_length = int(cfg.get("seq_length") or cfg.get("max_position_embeddings") or 2048)
    max_positions = int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or seq_length)
    vocab = int(require(cfg, source, "vocab_size", "padded_vocab_size"))
    eos = cfg.get("eos_token_id")
    if eos is None:  # Qwen v1 configs ship none: the tokenizer's fixed ids and ChatML stops
        eos = [i for i in (ENDOFTEXT_ID, IM_END_ID, IM_START_ID) if i < vocab]
    canonical = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon", 1e-6)),
        "rope_theta": float(cfg.get("rotary_emb_base", 10000.0)),
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "attention_bias": True,  # c_attn always has a bias
        "o_bias": False,
        "eos_token_id": eos,
        "torch_dtype": torch_dtype_name(cfg),
    }
    behaviours = {
        "rotary_dim": rotary_dim,
        "dynamic_ntk": bool(cfg.get("use_dynamic_ntk", False)),
        "logn_attn": bool(cfg.get("use_logn_attn", False)),
        "seq_length": seq_length,
    }
    return canonical, behaviours


def module_map(prefix: str, cfg: dict[str, Any]) -> list[ModuleTarget] | None:
    if prefix == "transformer.wte":
        return [ModuleTarget("model.embed_tokens")]
    if prefix == "transformer.ln_f":
        return [ModuleTarget("model.norm")]
    if prefix.startswith("transformer.visual") or prefix.endswith("rotary_emb"):
        return []  # Qwen-VL's vision tower; cached inverse frequencies
    match = _LAYER.match(prefix)
    if match is None:
        return None
    layer, rest = f"model.layers.{match.group(1)}", match.group(2)
    if rest == "attn.c_attn":
        size = cfg["num_attention_heads"] * cfg["head_dim"]
        return [
            ModuleTarget(f"{layer}.self_attn.q_proj", (0, size)),
            ModuleTarget(f"{layer}.self_attn.k_proj", (size, size)),
            ModuleTarget(f"{layer}.self_attn.v_proj", (2 * size, size)),
        ]
    if rest in _LAYER_NAMES:
        return [ModuleTarget(f"{layer}.{_LAYER_NAMES[rest]}")]
    return None


ADAPTER = FamilyAdapter(
    family="qwen",
    architectures=("QWenLMHeadModel",),
    needs=(
        "fused c_attn split into q/k/v (+bias), w2=gate / w1=up, intermediate_size halved; partial rotary; "
        "dynamic NTK per sequence + logn beyond seq_length; qwen.tiktoken via tiktoken; ChatML; GPTQ v1 Int4"
    ),
    translate=translate,
    module_map=module_map,
)
