"""Tiny random checkpoints of the non-Llama families, built by renaming native transformers models
(families.md section 8): each is saved in its family's own names and config, and the native model
is the oracle.

Knows: the tensor names and config fields of Qwen v1, ChatGLM2/3, Baichuan2 (remote-code formats
that transformers does not ship) and how they correspond to Qwen2 / Glm / Llama. Must not know:
qserve internals.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from tests.helpers.tiny_models import make_tiny_model


def _save(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def _layers(state: dict[str, torch.Tensor], num_layers: int):
    for i in range(num_layers):
        yield i, {k[len(f"model.layers.{i}.") :]: v for k, v in state.items() if k.startswith(f"model.layers.{i}.")}


# ------------------------------------------------------------------------------------ Qwen v1
def qwen2_oracle(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A Qwen2 model with as many KV heads as query heads: Qwen v1's math."""
    kwargs = dict(num_key_value_heads=4, num_attention_heads=4, max_position_embeddings=128)
    kwargs.update(overrides)
    return make_tiny_model("Qwen2ForCausalLM", seed=seed, **kwargs)


def qwen_v1_tensors(model: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    cfg = model.config
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "transformer.wte.weight": state["model.embed_tokens.weight"],
        "transformer.ln_f.weight": state["model.norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i, layer in _layers(state, cfg.num_hidden_layers):
        p = f"transformer.h.{i}"
        out[f"{p}.ln_1.weight"] = layer["input_layernorm.weight"]
        out[f"{p}.ln_2.weight"] = layer["post_attention_layernorm.weight"]
        out[f"{p}.attn.c_attn.weight"] = torch.cat([layer[f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[f"{p}.attn.c_attn.bias"] = torch.cat([layer[f"self_attn.{x}_proj.bias"] for x in "qkv"])
        out[f"{p}.attn.c_proj.weight"] = layer["self_attn.o_proj.weight"]
        out[f"{p}.mlp.w2.weight"] = layer["mlp.gate_proj.weight"]  # the SiLU branch
        out[f"{p}.mlp.w1.weight"] = layer["mlp.up_proj.weight"]
        out[f"{p}.mlp.c_proj.weight"] = layer["mlp.down_proj.weight"]
    return out


def qwen_v1_config(model: transformers.PreTrainedModel, seq_length: int, **extra) -> dict:
    cfg = model.config
    config = {
        "architectures": ["QWenLMHeadModel"],
        "model_type": "qwen",
        "auto_map": {"AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "kv_channels": cfg.hidden_size // cfg.num_attention_heads,
        "intermediate_size": 2 * cfg.intermediate_size,
        "rotary_pct": 1.0,
        "rotary_emb_base": cfg.rope_parameters["rope_theta"],
        "seq_length": seq_length,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_norm_epsilon": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "use_dynamic_ntk": True,
        "use_logn_attn": True,
        "no_bias": True,
        "fp32": True,
        "eos_token_id": cfg.eos_token_id,
    }
    config.update(extra)
    return config


def save_qwen_v1(model: transformers.PreTrainedModel, path: Path, seq_length: int = 2048) -> Path:
    from tests.helpers.tokenizer import make_tokenizer

    _save(path, qwen_v1_tensors(model), qwen_v1_config(model, seq_length))
    make_tokenizer(str(path))
    return path


def qwen_long_oracle(model: transformers.PreTrainedModel, prompt_len: int, seq_length: int):
    """Qwen v1's inference math for a sequence whose prompt has ``prompt_len`` tokens: a Qwen2
    copy with the NTK-scaled base (alpha fixed by the prompt length) and logn query scaling."""
    import copy

    oracle = copy.deepcopy(model)
    dim = model.config.hidden_size // model.config.num_attention_heads
    alpha = max(2 ** math.ceil(math.log2(prompt_len / seq_length) + 1) - 1, 1)
    base = model.config.rope_parameters["rope_theta"] * alpha ** (dim / (dim - 2))
    rotary = oracle.model.rotary_emb
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rotary.inv_freq = inv_freq
    rotary.original_inv_freq = inv_freq

    def logn_hook(_module, _inputs, output):  # [B, L, H * D]; positions 0..L-1 (no cache)
        positions = torch.arange(output.shape[1], dtype=torch.float32)
        factor = (torch.log(positions + 1) / math.log(seq_length)).clamp(min=1.0)
        return output * factor.view(1, -1, 1)

    for layer in oracle.model.layers:
        layer.self_attn.q_proj.register_forward_hook(logn_hook)
    return oracle


def save_qwen_v1_gptq(model: transformers.PreTrainedModel, path: Path, group_size: int = 32) -> Path:
    """The Qwen v1 GPTQ Int4 release layout (auto-gptq v1, sym, desc_act false): fused c_attn
    quantized whole with its real bias, every other quantized layer with an all-zero bias, fp16
    scales; ``model`` is overwritten with the dequantized weights, so it stays the oracle."""
    from tests.helpers.quant_packers import pack_gptq, rtn_quantize
    from tests.helpers.tokenizer import make_tokenizer

    tensors = qwen_v1_tensors(model)
    cfg = model.config
    dequant: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or not module.startswith("transformer.h.") or ".ln_" in module:
            continue
        weight = tensors.pop(name)  # [N, K]
        q = rtn_quantize(weight.t(), 4, group_size, sym=True)
        for suffix, tensor in pack_gptq(q, v1=True).items():
            tensors[f"{module}.{suffix}"] = tensor
        if f"{module}.bias" not in tensors:
            tensors[f"{module}.bias"] = torch.zeros(weight.shape[0], dtype=torch.float16)
        dequant[module] = q.dequant.t()  # [N, K]
    state = model.state_dict()
    with torch.no_grad():
        for i in range(cfg.num_hidden_layers):
            p, h = f"transformer.h.{i}", f"model.layers.{i}"
            q, k, v = dequant[f"{p}.attn.c_attn"].split(cfg.hidden_size)
            for proj, w in (("q", q), ("k", k), ("v", v)):
                state[f"{h}.self_attn.{proj}_proj.weight"].copy_(w)
            state[f"{h}.self_attn.o_proj.weight"].copy_(dequant[f"{p}.attn.c_proj"])
            state[f"{h}.mlp.gate_proj.weight"].copy_(dequant[f"{p}.mlp.w2"])
            state[f"{h}.mlp.up_proj.weight"].copy_(dequant[f"{p}.mlp.w1"])
            state[f"{h}.mlp.down_proj.weight"].copy_(dequant[f"{p}.mlp.c_proj"])
    config = qwen_v1_config(model, seq_length=2048, fp32=False, fp16=True)
    config["quantization_config"] = {
        "bits": 4,
        "group_size": group_size,
        "damp_percent": 0.01,
        "desc_act": False,
        "static_groups": False,
        "sym": True,
        "true_sequential": True,
        "model_name_or_path": None,
        "model_file_base_name": "model",
        "quant_method": "gptq",
    }
    _save(path, tensors, config)
    make_tokenizer(str(path))
    return path


# ------------------------------------------------------------------------------------ Baichuan2
def baichuan_tensors(model: transformers.PreTrainedModel, raw_lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    cfg = model.config
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {k: v for k, v in state.items() if not any(f".{x}_proj." in k for x in "qkv")}
    out["lm_head.weight"] = raw_lm_head
    for i, layer in _layers(state, cfg.num_hidden_layers):
        out[f"model.layers.{i}.self_attn.W_pack.weight"] = torch.cat(
            [layer[f"self_attn.{x}_proj.weight"] for x in "qkv"]
        )
    return out


def save_baichuan(model: transformers.PreTrainedModel, path: Path, position_embedding: str, seed: int = 0) -> Path:
    """Baichuan2 names and config; ``model``'s lm_head becomes the row-normalized copy of the raw
    (stored) rows, so it stays the oracle (NormHead)."""
    from tests.helpers.tokenizer import make_tokenizer

    cfg = model.config
    torch.manual_seed(seed)
    raw = torch.randn_like(model.lm_head.weight) * 0.5  # rows of varied norms
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.nn.functional.normalize(raw, dim=-1))
    config = {
        "architectures": ["BaichuanForCausalLM"],
        "model_type": "baichuan",
        "auto_map": {"AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "model_max_length": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eos_token_id": cfg.eos_token_id,
        "qserve_position_embedding": position_embedding,
        "qserve_norm_head": True,
    }
    _save(path, baichuan_tensors(model, raw), config)
    make_tokenizer(str(path))
    return path


def alibi_bias(num_heads: int, length: int) -> torch.Tensor:
    """[1, H, L, L] additive mask: HF Baichuan's slope * j on visible keys, -inf above the diagonal."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    slopes += [2 ** (-8 * (i + 1) / (2 * closest)) for i in range(2 * closest)][0::2][: num_heads - closest]
    slopes = torch.tensor(slopes)
    bias = slopes.view(-1, 1, 1) * torch.arange(length).view(1, 1, -1).float()  # [H, 1, L]
    causal = torch.full((length, length), float("-inf")).triu(1)
    return (bias + causal).unsqueeze(0)  # [1, H, L, L]


def alibi_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """Baichuan2-13B's math on a Llama: RoPE disabled by position 0 everywhere, ALiBi as the mask."""
    length = len(token_ids)
    mask = alibi_bias(model.config.num_attention_heads, length)
    with torch.no_grad():
        return (
            model(torch.tensor([token_ids]), attention_mask=mask, position_ids=torch.zeros(1, length, dtype=torch.long))
            .logits[0]
            .float()
        )  # [L, V]


# ------------------------------------------------------------------------------------ GLM
def glm_oracle(architecture: str = "GlmForCausalLM", seed: int = 0, rope_theta: float = 10000.0):
    """A native transformers GLM (random weights, like ``make_tiny_model``)."""
    from tests.helpers.tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    config_cls = {"GlmForCausalLM": transformers.GlmConfig, "Glm4ForCausalLM": transformers.Glm4Config}[architecture]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.5},
    )
    config.architectures = [architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.08)
            elif "bias" in name:
                param.normal_(0, 0.02)
            else:  # norms: not all ones, so that a missing or misplaced norm shows
                param.uniform_(0.5, 1.5)
    return model


def save_native(model: transformers.PreTrainedModel, path: Path) -> Path:
    from tests.helpers.tokenizer import make_tokenizer

    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(str(path))
    return path


def save_chatglm(model: transformers.PreTrainedModel, path: Path, rope_ratio: float) -> Path:
    """ChatGLM2/3's remote-code names and config from a GlmForCausalLM (theta = 10000 * rope_ratio)."""
    from tests.helpers.tokenizer import make_tokenizer

    cfg = model.config
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {
        "transformer.embedding.word_embeddings.weight": state["model.embed_tokens.weight"],
        "transformer.encoder.final_layernorm.weight": state["model.norm.weight"],
        "transformer.output_layer.weight": state["lm_head.weight"],
        "transformer.rotary_pos_emb.inv_freq": torch.ones(cfg.head_dim // 4),
    }
    for i, layer in _layers(state, cfg.num_hidden_layers):
        p = f"transformer.encoder.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = layer["input_layernorm.weight"]
        out[f"{p}.post_attention_layernorm.weight"] = layer["post_attention_layernorm.weight"]
        out[f"{p}.self_attention.query_key_value.weight"] = torch.cat(
            [layer[f"self_attn.{x}_proj.weight"] for x in "qkv"]
        )
        out[f"{p}.self_attention.query_key_value.bias"] = torch.cat([layer[f"self_attn.{x}_proj.bias"] for x in "qkv"])
        out[f"{p}.self_attention.dense.weight"] = layer["self_attn.o_proj.weight"]
        out[f"{p}.mlp.dense_h_to_4h.weight"] = layer["mlp.gate_up_proj.weight"]
        out[f"{p}.mlp.dense_4h_to_h.weight"] = layer["mlp.down_proj.weight"]
    config = {
        "architectures": ["ChatGLMModel"],
        "model_type": "chatglm",
        "auto_map": {"AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration"},
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "ffn_hidden_size": cfg.intermediate_size,
        "kv_channels": cfg.head_dim,
        "num_attention_heads": cfg.num_attention_heads,
        "multi_query_attention": True,
        "multi_query_group_num": cfg.num_key_value_heads,
        "padded_vocab_size": cfg.vocab_size,
        "seq_length": cfg.max_position_embeddings,
        "layernorm_epsilon": cfg.rms_norm_eps,
        "rmsnorm": True,
        "add_qkv_bias": True,
        "add_bias_linear": False,
        "post_layer_norm": True,
        "apply_residual_connection_post_layernorm": False,
        "rope_ratio": rope_ratio,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
    }
    _save(path, out, config)
    make_tokenizer(str(path))
    return path
