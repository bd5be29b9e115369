"""Tiny random-weight checkpoints of each supported architecture, built with transformers.

Knows: how to make a small HF config + model for Llama / Mistral / Qwen2 / Qwen3, save it as
safetensors (single file or sharded) with the test tokenizer. Must not know: qserve internals.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from tests.helpers.tokenizer import make_tokenizer

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_CONFIG_CLASSES = {
    "LlamaForCausalLM": "LlamaConfig",
    "MistralForCausalLM": "MistralConfig",
    "Qwen2ForCausalLM": "Qwen2Config",
    "Qwen3ForCausalLM": "Qwen3Config",
}


def tiny_config(architecture: str, **overrides) -> transformers.PretrainedConfig:
    tokenizer = make_tokenizer()
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    if architecture == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 16
    if architecture == "MistralForCausalLM":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = getattr(transformers, _CONFIG_CLASSES[architecture])(**kwargs)
    config.architectures = [architecture]
    return config


def make_tiny_model(architecture: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    config = tiny_config(architecture, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).float().eval()
    # Larger-than-default random weights make logits well separated, so greedy decoding is
    # not decided by float rounding.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.08)
            elif "bias" in str(param):
                param.normal_(0, 0.02)
    return model


def save_tiny_checkpoint(
    model: transformers.PreTrainedModel,
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    shard_size: str | None = None,
) -> Path:
    path = Path(path)
    model = model.to(dtype)
    kwargs = {"safe_serialization": True}
    if shard_size:
        kwargs["max_shard_size"] = shard_size
    model.save_pretrained(path, **kwargs)
    make_tokenizer(str(path))
    return path
