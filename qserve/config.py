"""Frozen configuration objects: the model (read from an HF ``config.json``), the KV cache, the
scheduler, and the engine that ties them together.

Knows: how to read and validate HF Llama-family configs (both the classic ``rope_theta`` /
``rope_scaling`` keys and transformers v5's ``rope_parameters``); other families' configs are
first translated into that shape by their adapter (``qserve.model.registry.model_config``),
which also declares their behaviours (partial / interleaved rotary, ALiBi, normalized lm_head, dynamic
NTK + logn, sandwich norms). Must not know: weights, tensors on devices, the engine's
moving parts, or which families exist (it imports nothing from ``qserve.model``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# HF architecture name -> the features that distinguish it inside the one Llama-family decoder.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "MistralForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; supported: {sorted(set(_DTYPES))}")
    return _DTYPES[key]


@dataclass(frozen=True, slots=True)
class RopeConfig:
    rope_type: str  # "default" | "linear" | "llama3"
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype  # the checkpoint's declared dtype
    eos_token_ids: tuple[int, ...]
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False, default_factory=dict)
    # Declared behaviours of non-Llama families (qserve.model.registry); defaults are Llama's.
    family: str = "llama"
    rotary_dim: int | None = None  # dims of each head that rotate (None: all of head_dim)
    rope_interleaved: bool = False  # rotate pairs (2i, 2i+1) instead of NeoX halves (ChatGLM / GLM)
    alibi: bool = False  # ALiBi position biases instead of rotary (Baichuan2-13B)
    lm_head_normalized: bool = False  # NormHead: lm_head rows L2-normalized at load (Baichuan2)
    sandwich_norms: bool = False  # extra norms after attention and MLP outputs (GLM-4-0414)
    dynamic_ntk: bool = False  # Qwen v1: rotary base scaled per sequence from its prompt length
    logn_attn: bool = False  # Qwen v1: query scaled by log_S(position + 1) beyond seq_length
    seq_length: int | None = None  # Qwen v1: the training length that gates dynamic NTK and logn
    # Mixture of experts (qserve.model.families.moe): which layers' MLP is a routed block of
    # ``num_experts`` SwiGLU experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to one
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert with a sigmoid gate
    moe_layers: tuple[int, ...] = ()
    moe_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """A Llama-family ``config.json`` (other families: ``qserve.model.registry.model_config``)."""
        architectures = cfg.get("architectures") or []
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: architecture {architectures or cfg.get('model_type')!r} is not a Llama-family "
                f"architecture ({', '.join(SUPPORTED_ARCHITECTURES)}); qserve.model.registry.model_config "
                "translates the other families"
            )
        features = SUPPORTED_ARCHITECTURES[arch]
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            value = cfg.get(key)
            if key in cfg and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )
        attention_bias = bool(cfg.get("attention_bias", False))
        o_bias = bool(cfg.get("o_bias", attention_bias))  # adapters of families with q/k/v-only biases set it
        if cfg.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        sliding_window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            sliding_window = None  # Qwen configs carry a window they do not use unless asked
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_read_rope(cfg, source),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or features["qkv_bias"],
            o_bias=o_bias,
            qk_norm=features["qk_norm"],
            sliding_window=int(sliding_window) if sliding_window else None,
            dtype=parse_dtype(dtype_name),
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def kv_bytes_per_token(self, kv_dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_dtype_bytes


def _read_rope(cfg: dict[str, Any], source: str) -> RopeConfig:
    # transformers v5 writes rope_parameters (with rope_theta inside); v4 checkpoints write
    # rope_theta + rope_scaling. Accept both.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return RopeConfig(
        rope_type=rope_type,
        theta=theta,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: the memory planner decides
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
