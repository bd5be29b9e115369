"""Reading HF configs: architectures, RoPE variants, refusals that name the field."""

from __future__ import annotations

import pytest

from qserve.config import ModelConfig
from qserve.model.registry import model_config

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
}


def test_transformers_v5_rope_parameters_are_read():
    cfg = ModelConfig.from_hf({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert cfg.rope.theta == 5e5 and cfg.rope.rope_type == "default"


def test_classic_rope_scaling_is_read():
    cfg = ModelConfig.from_hf({**BASE, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert cfg.rope.rope_type == "linear" and cfg.rope.factor == 2.0


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_types_are_refused_by_name(rope_type):
    with pytest.raises(ValueError, match=f"{rope_type}.*supported: default, linear, llama3"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": rope_type, "factor": 4.0}})


def test_qwen2_has_qkv_bias_and_ignores_unused_sliding_window():
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096})
    assert cfg.qkv_bias and not cfg.o_bias and cfg.sliding_window is None


def test_qwen3_head_dim_and_qk_norm():
    cfg = ModelConfig.from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert cfg.head_dim == 32 and cfg.qk_norm


def test_unsupported_architecture_names_supported_ones():
    with pytest.raises(ValueError, match="FalconForCausalLM.*LlamaForCausalLM, MistralForCausalLM"):
        model_config({**BASE, "architectures": ["FalconForCausalLM"]})


def test_model_config_reads_only_llama_family_configs():
    """Other families reach ModelConfig translated (qserve.model.registry); config knows no family."""
    with pytest.raises(ValueError, match="QWenLMHeadModel.*not a Llama-family architecture.*registry"):
        ModelConfig.from_hf({**BASE, "architectures": ["QWenLMHeadModel"]})


def test_bad_head_grouping_is_named():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf({**BASE, "num_key_value_heads": 3})
