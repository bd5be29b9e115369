"""The memory planner for mixture-of-experts models: every expert is resident, and Qwen3-30B-A3B's
published shapes give the numbers families.md derives (config-only directory, no weights)."""

from __future__ import annotations

import json

import torch

from qserve.cli import main
from qserve.memory.planner import weight_bytes
from qserve.model.registry import read_model_config

GIB = 2**30

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B config.json fields (families.md (d)), GPTQ 4-bit g128
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "eos_token_id": 151645,
    "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
}


def test_qwen3_30b_a3b_config_and_weights(tmp_path):
    import loaders

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    config = read_model_config(tmp_path)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (128, 8, 768)
    assert config.moe_layers == tuple(range(48)) and config.qk_norm
    assert config.kv_bytes_per_token(2) == 96 * 1024  # 48 layers x 4 KV heads x 128 x (K, V) x 2 bytes
    spec = loaders.detect(tmp_path)
    weights = weight_bytes(config, spec, torch.bfloat16)
    # 29.9B linear parameters at 4 bits + g128 scales (15.4 GB) + bf16 embeddings and lm_head (1.24 GB)
    assert 15.2 * GIB < weights < 15.8 * GIB
    dense = weight_bytes(config, None, torch.bfloat16)  # all 128 experts of every layer resident
    assert 56 * GIB < dense < 58 * GIB
    assert spec.module_quant("model.layers.0.mlp.experts.127.down_proj") is not None
    assert spec.module_quant("model.layers.0.mlp.gate") is None  # the router stays 16-bit


def test_plan_qwen3_30b_a3b_in_24gib(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    fits = {}
    for kv in ("auto", "fp8", "int4"):
        args = ["plan", str(tmp_path), "--gpu-memory-budget", "24GiB", "--kv-cache-dtype", kv, "--json"]
        assert main(args) == 0
        plan = json.loads(capsys.readouterr().out)
        fits[kv] = plan["concurrent_sequences_at"]["1024"]
        total = plan["weights_bytes"] + plan["activation_bytes"] + plan["overhead_bytes"] + plan["kv_cache_bytes"]
        assert total <= 24 * GIB
    assert 40 <= fits["auto"] < fits["fp8"] < fits["int4"]  # fp16 KV: families.md's ~40 one-k sequences
    assert fits["fp8"] >= 2 * fits["auto"] - 1


def test_lora_slot_bytes_under_expert_parallelism_ignore_the_expert_width(tmp_path, capsys):
    """LoRA adapts attention and dense MLPs only, so its per-rank slot bytes do not depend on how the
    routed experts split: with expert parallelism an expert width the ranks cannot split (whole
    experts per rank) must not refuse the plan (it did: the LoRA count split the experts as if
    expert parallelism were off)."""
    from qserve.memory.planner import lora_slot_bytes

    odd = {**QWEN3_30B_A3B, "moe_intermediate_size": 100}  # 100 % 8 != 0; 128 experts % 8 == 0
    (tmp_path / "config.json").write_text(json.dumps(odd))
    config = read_model_config(tmp_path)
    per_rank = lora_slot_bytes(config, 4, 16, torch.bfloat16, 8, enable_expert_parallel=True)
    # attention only (every layer is MoE): qkv A [3R, H] + B [(q + 2kv) / 8, R]; o A [R, q / 8] + B [H, R]
    h, r, q, kv = 2048, 16, 32 * 128 // 8, max(4 // 8, 1) * 128
    assert per_rank == 4 * 48 * (3 * r * h + (q + 2 * kv) * r + r * q + h * r) * 2
    args = ["plan", str(tmp_path), "--gpu-memory-budget", "24GiB", "--json", "--enable-lora", "--max-loras", "4"]
    args += ["--tensor-parallel-size", "8", "--enable-expert-parallel"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["lora_bytes"] == per_rank
