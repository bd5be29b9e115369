"""ChatGLM2 / ChatGLM3 / GLM-4 in the remote-code ``chatglm`` format as the Llama-style decoder.

Knows (families.md (b)): the config fields (``num_layers``, ``ffn_hidden_size``, ``kv_channels``,
``multi_query_group_num``, ``padded_vocab_size``, ``rope_ratio``...), the tensor names under
``transformer.`` (fused ``query_key_value`` = q | k | v rows with bias, fused ``dense_h_to_4h`` =
gate | up), and the declared behaviours: rotary on the first half of each head as interleaved
pairs with base 10000 * rope_ratio. Variants qserve does not serve (LayerNorm instead of RMSNorm,
post-norm residuals, linear biases) are refused by field. Must not know: tensors or devices.
"""

from __future__ import annotations

import re
from typing import Any

from loaders.renamed import ModuleTarget
from qserve.model.adapter import FamilyAdapter, refuse_unless, require, torch_dtype_name

_LAYER = re.compile(r"^transformer\.encoder\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",
    "self_attention.dense": "self_attn.o_proj",
    "mlp.dense_4h_to_h": "mlp.down_proj",
}


def translate(cfg: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, Any]]:
    hidden = int(require(cfg, source, "hidden_size"))
    heads = int(require(cfg, source, "num_attention_heads"))
    head_dim = int(cfg.get("kv_channels") or hidden // heads)
    kv_heads = int(cfg.get("multi_query_group_num") or heads) if cfg.get("multi_query_attention") else heads
    refuse_unless(cfg.get("rmsnorm", True), source, "rmsnorm", cfg.get("rmsnorm"), "true")
    refuse_unless(not cfg.get("add_bias_linear", False), source, "add_bias_linear", True, "false")
    refuse_unless(cfg.get("post_layer_norm", True), source, "post_layer_norm", cfg.get("post_layer_norm"), "true")
    refuse_unless(
        not cfg.get("apply_residual_connection_post_layernorm", False),
        source,
        "apply_residual_connection_post_layernorm",
        True,
        "false",
    )
    refuse_unless(head_dim % 4 == 0, source, "kv_channels", head_dim, "a multiple of 4")
    seq_length = int(cfg.get("seq_length") or 2048)
    canonical = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(require(cfg, source, "padded_vocab_size", "vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": int(require(cfg, source, "ffn_hidden_size")),
        "num_hidden_layers": int(require(cfg, source, "num_layers", "num_hidden_layers")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(cfg.get("layernorm_epsilon", 1e-5)),
        "rope_theta": 10000.0 * float(cfg.get("rope_ratio") or 1.0),
        "max_position_embeddings": seq_length,
        "tie_word_embeddings": False,
        "attention_bias": bool(cfg.get("add_qkv_bias", False)),
        "o_bias": False,
        "eos_token_id": cfg.get("eos_token_id", 2),
        "torch_dtype": torch_dtype_name(cfg),
    }
    return canonical, {"rotary_dim": head_dim // 2, "rope_interleaved": True}


def module_map(prefix: str, cfg: dict[str, Any]) -> list[ModuleTarget] | None:
    if prefix == "transformer.embedding.word_embeddings":
        return [ModuleTarget("model.embed_tokens")]
    if prefix == "transformer.encoder.final_layernorm":
        return [ModuleTarget("model.norm")]
    if prefix == "transformer.output_layer":
        return [ModuleTarget("lm_head")]
    if prefix == "transformer.rotary_pos_emb":
        return []  # cached inverse frequencies
    match = _LAYER.match(prefix)
    if match is None:
        return None
    layer, rest = f"model.layers.{match.group(1)}", match.group(2)
    if rest == "self_attention.query_key_value":
        q_size = cfg["num_attention_heads"] * cfg["head_dim"]
        kv_size = cfg["num_key_value_heads"] * cfg["head_dim"]
        return [
            ModuleTarget(f"{layer}.self_attn.q_proj", (0, q_size)),
            ModuleTarget(f"{layer}.self_attn.k_proj", (q_size, kv_size)),
            ModuleTarget(f"{layer}.self_attn.v_proj", (q_size + kv_size, kv_size)),
        ]
    if rest == "mlp.dense_h_to_4h":
        size = cfg["intermediate_size"]
        return [ModuleTarget(f"{layer}.mlp.gate_proj", (0, size)), ModuleTarget(f"{layer}.mlp.up_proj", (size, size))]
    if rest in _LAYER_NAMES:
        return [ModuleTarget(f"{layer}.{_LAYER_NAMES[rest]}")]
    return None


ADAPTER = FamilyAdapter(
    family="chatglm",
    architectures=("ChatGLMModel", "ChatGLMForConditionalGeneration"),
    needs=(
        "query_key_value split (multi-query groups), dense_h_to_4h split into gate/up; rotary on the first "
        "half of each head as interleaved pairs, base 10000*rope_ratio; SentencePiece tokenizer + [gMASK]sop"
    ),
    translate=translate,
    module_map=module_map,
)
