"""One decoder for the Llama family: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Knows: the layer structure, HF parameter names and how checkpoint tensors route into fused
layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Must not know: checkpoint formats (the
loader hands it tensors or ``PackedQuantWeight``), scheduling or sampling. Every forward runs
over all of the step's tokens at once: ``[num_tokens, hidden]``, no per-request loops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from qserve.config import ModelConfig
from qserve.distributed.parallel_linear import column_linear, lm_head_linear, row_linear, vocab_embedding
from qserve.distributed.parallel_state import TPGroup
from qserve.distributed.sharding import AttentionShard, attention_shard
from qserve.layers.attention import PagedAttention
from qserve.layers.linear import Linear, LinearMethod
from qserve.layers.norm import RMSNorm
from qserve.layers.rotary import RotaryEmbedding
from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels import elementwise_ops
from quant_kernels.layout import PackedQuantWeight

logger = logging.getLogger(__name__)

# Given the HF names of a layer's shards, return how that layer stores and multiplies weights.
LinearMethodFactory = Callable[[list[str]], LinearMethod]

# HF sub-module name -> (qserve fused module name, shard id)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Attention(nn.Module):
    """With a ``tp`` group: this rank's heads only (qkv column-parallel, o_proj row-parallel)."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        dtype: torch.dtype,
        make_method: LinearMethodFactory,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        shard = _attention_shard(config, tp)
        self.num_heads = config.num_heads if shard is None else shard.num_heads
        self.num_kv_heads = config.num_kv_heads if shard is None else shard.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = column_linear(
            config.hidden_size,
            [q_size, kv_size, kv_size],
            tp=tp,
            shard_slices=None if shard is None else shard.qkv_slices(config.head_dim),
            bias=config.qkv_bias,
            params_dtype=dtype,
            method=make_method([f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"]),
            prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = row_linear(
            q_size,
            [config.hidden_size],
            tp=tp,
            bias=config.o_bias,
            params_dtype=dtype,
            method=make_method([f"{prefix}.o_proj"]),
            prefix=f"{prefix}.o_proj",
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, config.sliding_window)

    def forward(
        self,
        positions: torch.Tensor,  # int64 [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [num_tokens, (H + 2 * Hkv) * D]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = rotary(positions, query, key)
        out = self.attn(query, key, value, kv_cache, metadata)  # [num_tokens, H, D]
        return self.o_proj(out.reshape(num_tokens, q_size))


def _attention_shard(config: ModelConfig, tp: TPGroup | None) -> AttentionShard | None:
    return None if tp is None else attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.size)


class MLP(nn.Module):
    """With a ``tp`` group: gate_up column-parallel, down_proj row-parallel over the intermediate size."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        dtype: torch.dtype,
        make_method: LinearMethodFactory,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size // (1 if tp is None else tp.size)  # per rank
        self.gate_up_proj = column_linear(
            config.hidden_size,
            [config.intermediate_size, config.intermediate_size],
            tp=tp,
            bias=False,
            params_dtype=dtype,
            method=make_method([f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = row_linear(
            config.intermediate_size,
            [config.hidden_size],
            tp=tp,
            bias=False,
            params_dtype=dtype,
            method=make_method([f"{prefix}.down_proj"]),
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate_up = self.gate_up_proj(hidden)  # [num_tokens, 2 * intermediate (this rank's)]
        return self.down_proj(elementwise_ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        dtype: torch.dtype,
        make_method: LinearMethodFactory,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, f"{prefix}.self_attn", dtype, make_method, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, f"{prefix}.mlp", dtype, make_method, tp)

    def forward(
        self,
        positions: torch.Tensor,  # int64 [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the residual stream before ``hidden`` is added
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp_out, residual)``; the caller's next norm adds them. Carrying the residual
        this way lets each add ride inside the following norm's kernel."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        attn_out = self.self_attn(positions, normed, rotary, kv_cache, metadata)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        return self.mlp(normed), residual


class LlamaFamilyForCausalLM(nn.Module):
    """The decoder plus its LM head. Parameter names follow HF (``model.layers.0...``).

    With a ``tp`` group (qserve.distributed) the model is this rank's shard: vocabulary-parallel
    embedding and LM head, column/row-parallel linears, this rank's attention heads; the
    collectives run inside the forward, and ``compute_logits`` returns the full vocabulary on
    every rank.
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, make_method: LinearMethodFactory, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.model = nn.Module()
        self.model.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, f"model.layers.{i}", dtype, make_method, tp) for i in range(config.num_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = lm_head_linear(
                config.hidden_size,
                config.vocab_size,
                tp=tp,
                bias=False,
                params_dtype=dtype,
                method=make_method(["lm_head"]),
                prefix="lm_head",
            )

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # one (key, value) pair per layer
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, self.rotary, kv_cache, metadata)
        if residual is None:  # a model without layers
            return self.model.norm(hidden)
        return self.model.norm.add_and_norm(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> float32 [R, vocab]
        if self.lm_head is None and self.tp is not None:
            return self.model.embed_tokens.compute_logits(hidden).float()  # vocabulary-parallel, gathered
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------------------------------
    # Weight loading
    # ------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedQuantWeight]]) -> None:
        """Route checkpoint tensors (HF names) into this model; every weight must arrive.

        Dense tensors come as ``(param_name, tensor)``; quantized linears as
        ``(module_prefix, PackedQuantWeight)``.
        """
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        loaded_shards: dict[str, set[int]] = {name: set() for name in linears}
        plain_params = {
            name for name, _ in self.named_parameters() if not any(name.startswith(f"{lin}.") for lin in linears)
        }
        loaded_params: set[str] = set()
        for name, value in weights:
            if "rotary_emb" in name:
                continue
            if isinstance(value, PackedQuantWeight):
                module_path, leaf = name, "weight"
            else:
                module_path, _, leaf = name.rpartition(".")
            parent, _, sub = module_path.rpartition(".")
            if sub in _FUSED_SHARDS:
                layer_name, shard_id = f"{parent}.{_FUSED_SHARDS[sub][0]}", _FUSED_SHARDS[sub][1]
            else:
                layer_name, shard_id = module_path, 0
            if layer_name in linears and leaf in ("weight", "bias"):
                if leaf == "weight":
                    linears[layer_name].load_weight(shard_id, value)
                    loaded_shards[layer_name].add(shard_id)
                else:
                    linears[layer_name].load_bias(shard_id, value)
            elif name in plain_params and hasattr(self.get_parameter(name), "weight_loader"):
                self.get_parameter(name).weight_loader(value)  # a sharded parameter slices for itself
                loaded_params.add(name)
            elif name in plain_params:
                param = self.get_parameter(name)
                if tuple(param.shape) != tuple(value.shape):
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(value.shape)} disagrees with the config's {tuple(param.shape)}"
                    )
                param.data.copy_(value)
                loaded_params.add(name)
            elif name.startswith("lm_head") and self.lm_head is None:
                continue  # tied embeddings: the checkpoint's copy of lm_head is redundant
            else:
                logger.warning("ignoring checkpoint tensor %s (not used by %s)", name, self.config.architecture)
        missing = sorted(plain_params - loaded_params)
        for layer_name, layer in linears.items():
            missing += [
                f"{layer_name} shard {i}" for i in range(len(layer.output_sizes)) if i not in loaded_shards[layer_name]
            ]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")
        for layer in linears.values():
            layer.process_after_loading()
