"""One decoder for every family: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), and,
through ``qserve.model.registry`` (config translation + checkpoint name map), Qwen v1, ChatGLM,
GLM / GLM-4, Baichuan and the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral: the
sparse layers' MLP is a ``qserve.layers.moe.SparseMoeBlock``).

Knows: the layer structure, HF parameter names and how checkpoint tensors route into fused
layers (q/k/v -> qkv_proj, gate/up -> gate_up_proj), and the behaviours ``ModelConfig`` declares:
partial / interleaved / NTK-scaled rotary with logn (``RotaryEmbedding``), ALiBi instead of
rotary, a row-normalized lm_head (NormHead) and sandwich norms. Must not know: checkpoint formats (the
loader hands it tensors or ``PackedQuantWeight``), scheduling or sampling. Every forward runs
over all of the step's tokens at once: ``[num_tokens, hidden]``, no per-request loops.

``QSERVE_FUSED_QK_NORM_ROPE`` (on unless ``0``, since the H100 smoke at ``f609d24``; read once per
``Attention`` when the model is built): a q/k-norm model (Qwen3, Qwen3-MoE) hands its q_norm / k_norm
weights to the rotary, which runs norms and rotation as one launch on CUDA. Qwen3-30B-A3B's batch-1
decode is launch-bound (~785 CUDA-graph nodes a step): two launches fewer a layer, 96 over its 48
layers; its batch-1 decode 336.0 tok/s against 320.6 with three launches (H100, bench/RESULTS.md,
sixteenth session).

``QSERVE_FUSED_ROPE_KV_STORE`` (on unless ``0``: +2.3% at Qwen3-30B-A3B batch 1, +1.5% on the 14B, H100): ``Attention.rotary_store`` hands
the rotary the step's values, cache and slots, so its launch also stores the keys and values and the
attention launches no ``store_kv`` (whole-head rotary, a cache in the activations' dtype; the piecewise
graphs' ``pre_attention`` passes none: their eager attention stores).

``QSERVE_LORA_FUSED_SILU`` (off unless ``1``; read once per ``MLP``): with adapters in the step, gate_up's
expand runs inside the SiLU-and-mul (``quant_kernels.lora_ops.finish_lora_silu_and_mul``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from qserve.config import ModelConfig
from qserve.distributed.parallel_linear import column_linear, lm_head_linear, row_linear, vocab_embedding
from qserve.distributed.parallel_moe import moe_block
from qserve.distributed.parallel_state import TPGroup
from qserve.distributed.sharding import AttentionShard, attention_shard
from qserve.layers.attention import PagedAttention, alibi_slopes
from qserve.layers.linear import DenseLinearMethod, Linear, LinearMethod
from qserve.layers.moe import SparseMoeBlock
from qserve.layers.norm import RMSNorm
from qserve.layers.rotary import RotaryEmbedding, interleaved_permutation, num_ntk_tables
from qserve.runner.attn_metadata import AttentionMetadata
from quant_kernels import elementwise_ops, lora_ops
from quant_kernels.kv_store import KVStore
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.lora_ops import LoRAIndices
from quant_kernels.switches import env_switch

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
# qserve fused module name -> the HF sub-modules of its output slices, in order (LoRA maps adapters' per-
# projection matrices onto these slices).
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# A routed expert's weight: (MoE block module path, expert index, projection name)
_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.([A-Za-z0-9_]+)$")
# Any checkpoint name of a routed expert (module prefix, or a tensor under it): (block path, expert index)
_EXPERT_TENSOR = re.compile(r"^(.+)\.experts\.(\d+)\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?$")
# "1" / unset (the default: measured faster, bench/RESULTS.md, sixteenth session): q_norm, k_norm and
# rotary as one op (one launch on CUDA); "0": three
FUSED_QK_NORM_ROPE_ENV = "QSERVE_FUSED_QK_NORM_ROPE"
# "1": the rotary's launch also stores the step's keys and values into a model-dtype paged cache (no
# store_kv launch; the default: measured faster, seventeenth session); "0": the attention stores them
FUSED_ROPE_KV_STORE_ENV = "QSERVE_FUSED_ROPE_KV_STORE"


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
        # Read for every model, so a bad value is refused whatever the family; it changes only q/k-norm ones.
        self.fused_qk_norm_rope = env_switch(FUSED_QK_NORM_ROPE_ENV, default=True) and self.q_norm is not None
        self.fused_rope_kv_store = env_switch(FUSED_ROPE_KV_STORE_ENV, default=True)
        slopes = None
        if config.alibi:  # this rank's heads' slopes
            start = 0 if shard is None else shard.q_head_start
            slopes = alibi_slopes(config.num_heads)[start : start + self.num_heads]
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, config.head_dim, config.sliding_window, slopes)

    def forward(
        self,
        positions: torch.Tensor,  # int64 [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        rotary: RotaryEmbedding | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        lora: LoRAIndices | None = None,
    ) -> torch.Tensor:
        store = self.rotary_store(rotary, kv_cache, metadata, hidden.dtype)
        query, key, value = self.project_qkv(positions, hidden, rotary, metadata.ntk_tables, lora, store)
        out = self.attn(query, key, value, kv_cache, metadata, kv_stored=store is not None)  # [num_tokens, H, D]
        return self.project_out(out, lora)

    def rotary_store(
        self,
        rotary: RotaryEmbedding | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        dtype: torch.dtype,  # the activations'
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """``(kv_cache, slot_mapping)`` for ``project_qkv`` to store the keys and values in the rotary's
        launch (``QSERVE_FUSED_ROPE_KV_STORE`` not ``0``, a whole-head rotary, a cache in the activations' dtype:
        fp8 / int8 / int4 caches keep the attention's store); else None: the attention stores them."""
        if not self.fused_rope_kv_store or rotary is None or not rotary.stores_kv:
            return None
        key_cache, value_cache = kv_cache
        if key_cache.dtype != dtype or value_cache.dtype != dtype or key_cache.dim() != 4:
            return None
        return kv_cache, metadata.slot_mapping

    def project_qkv(
        self,
        positions: torch.Tensor,  # int64 [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        rotary: RotaryEmbedding | None,
        ntk_tables: torch.Tensor | None,  # int64 [num_tokens] or None (AttentionMetadata.ntk_tables)
        lora: LoRAIndices | None = None,
        store: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,  # rotary_store's
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the paged attention: q/k/v projection, q/k norms, rotary. Returns query
        ``[T, H, D]``, key and value ``[T, Hkv, D]``. Split from ``forward`` so piecewise CUDA graphs
        (qserve.runner.piecewise_graphs) capture it apart from the attention, with the same math.
        With ``store`` (``rotary_store``'s) the rotary also writes the keys and values into the cache:
        the caller's attention then must not (``PagedAttention.forward(kv_stored=True)``)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden, lora)  # [num_tokens, (H + 2 * Hkv) * D]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        kv_store = None
        if store is not None:
            (key_cache, value_cache), slot_mapping = store
            kv_store = KVStore(value, key_cache, value_cache, slot_mapping)
        if self.fused_qk_norm_rope and rotary is not None:  # the norms ride in the rotary's launch
            qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            query, key = rotary(positions, query, key, ntk_tables, qk_norm=qk_norm, kv_store=kv_store)
            return query, key, value
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        if rotary is not None:  # None: ALiBi models
            query, key = rotary(positions, query, key, ntk_tables, kv_store=kv_store)
        return query, key, value

    def project_out(self, out: torch.Tensor, lora: LoRAIndices | None = None) -> torch.Tensor:
        """``out`` ``[T, H, D]`` (the attention's output) -> ``[T, hidden]`` through o_proj."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim), lora)


def _rotary(config: ModelConfig) -> RotaryEmbedding:
    """The model's rotary embedding with its declared variants (partial, interleaved, Qwen NTK/logn)."""
    max_positions = config.max_position_embeddings
    tables, logn = 1, None
    if config.seq_length is not None and max_positions > config.seq_length:
        if config.dynamic_ntk:
            tables = num_ntk_tables(max_positions, config.seq_length)
        if config.logn_attn:
            logn = config.seq_length
    return RotaryEmbedding(
        config.rope,
        config.head_dim,
        max_positions,
        rotary_dim=config.rotary_dim,
        interleaved=config.rope_interleaved,
        num_ntk_tables=tables,
        logn_seq_length=logn,
        permute_inputs=_qk_row_permutation(config) is None,
    )


def _qk_row_permutation(config: ModelConfig) -> torch.Tensor | None:
    """int64 [head_dim]: the order of each head's q/k projection rows that makes an interleaved
    rotary (ChatGLM / GLM) a NeoX one. Applied once at load, so no step gathers q and k. None
    when rotary is not interleaved, or when q/k norms (which read dims in checkpoint order) sit
    between the projection and the rotary."""
    if not config.rope_interleaved or config.alibi or config.qk_norm:
        return None
    return interleaved_permutation(config.rotary_dim or config.head_dim, config.head_dim)


def _permute_head_rows(
    value: torch.Tensor | PackedQuantWeight, order: torch.Tensor, head_dim: int
) -> torch.Tensor | PackedQuantWeight:
    """A q or k projection's output rows (dense weight [N, K] / bias [N]; canonical quantized
    columns of qweight, scales, zeros) reordered by ``order`` within every head of ``head_dim``."""
    if isinstance(value, PackedQuantWeight):
        num_out = value.out_features
    else:
        num_out = value.shape[0]
    index = (torch.arange(0, num_out, head_dim, device="cpu")[:, None] + order.cpu()[None, :]).flatten()  # [N]
    if not isinstance(value, PackedQuantWeight):
        return value.index_select(0, index.to(value.device))

    def columns(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(1, index.to(t.device))

    return PackedQuantWeight(
        value.bits, value.group_size, columns(value.qweight), columns(value.scales), columns(value.zeros), value.perm
    )


def _attention_shard(config: ModelConfig, tp: TPGroup | None) -> AttentionShard | None:
    return None if tp is None else attention_shard(config.num_heads, config.num_kv_heads, tp.rank, tp.size)


class MLP(nn.Module):
    """With a ``tp`` group: gate_up column-parallel, down_proj row-parallel over the intermediate size
    (``reduce_results=False``: its output is the rank's partial sum, for a MoE block to all-reduce)."""

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        dtype: torch.dtype,
        make_method: LinearMethodFactory,
        tp: TPGroup | None = None,
        intermediate_size: int | None = None,  # a MoE block's shared expert has its own width
        reduce_results: bool = True,
    ) -> None:
        super().__init__()
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.intermediate_size = inter // (1 if tp is None else tp.size)  # per rank
        self.fused_lora_silu = lora_ops.fused_silu_enabled()  # QSERVE_LORA_FUSED_SILU, read once
        self.gate_up_proj = column_linear(
            config.hidden_size,
            [inter, inter],
            tp=tp,
            bias=False,
            params_dtype=dtype,
            method=make_method([f"{prefix}.gate_proj", f"{prefix}.up_proj"]),
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = row_linear(
            inter,
            [config.hidden_size],
            tp=tp,
            reduce_results=reduce_results,
            bias=False,
            params_dtype=dtype,
            method=make_method([f"{prefix}.down_proj"]),
            prefix=f"{prefix}.down_proj",
        )

    def forward(self, hidden: torch.Tensor, lora: LoRAIndices | None = None) -> torch.Tensor:  # [T, hidden]
        if self.fused_lora_silu and lora is not None:
            # QSERVE_LORA_FUSED_SILU: gate_up's adapter expand inside the SiLU-and-mul (one launch, not two)
            gate_up, pending = self.gate_up_proj.forward_unexpanded(hidden, lora)  # [T, 2 * intermediate]
            w = self.gate_up_proj.lora
            if pending is None:  # no adapter slots on gate_up
                act = elementwise_ops.silu_and_mul(gate_up)
            else:
                act = lora_ops.finish_lora_silu_and_mul(gate_up, pending, w.b, w.slice_starts, lora)
        else:
            act = elementwise_ops.silu_and_mul(self.gate_up_proj(hidden, lora))  # [T, intermediate (this rank's)]
        return self.down_proj(act, lora)


def _moe_block(
    config: ModelConfig,
    prefix: str,
    dtype: torch.dtype,
    make_method: LinearMethodFactory,
    tp: TPGroup | None,
    enable_expert_parallel: bool = False,
) -> SparseMoeBlock:
    """The sparse layer's MLP. With a ``tp`` group (``qserve.distributed.parallel_moe``): the rank's
    routed experts (whole ones with ``enable_expert_parallel``, else a slice of each) and a
    tensor-parallel shared expert, summed over ranks by the block's one all-reduce."""
    gate_name = config.moe_expert_names[0]
    quantized = not isinstance(make_method([f"{prefix}.experts.0.{gate_name}"]), DenseLinearMethod)
    shared = None
    if config.shared_expert_intermediate_size:
        shared = MLP(
            config,
            f"{prefix}.shared_expert",
            dtype,
            make_method,
            tp,
            intermediate_size=config.shared_expert_intermediate_size,
            reduce_results=False,  # the block's all-reduce sums it with the routed experts
        )
    return moe_block(
        tp=tp,
        enable_expert_parallel=enable_expert_parallel,
        prefix=prefix,
        hidden_size=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        renormalize=config.norm_topk_prob,
        expert_names=config.moe_expert_names,
        quantized=quantized,
        dtype=dtype,
        shared_expert=shared,
    )


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        dtype: torch.dtype,
        make_method: LinearMethodFactory,
        tp: TPGroup | None = None,
        layer_index: int = 0,
        enable_expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, f"{prefix}.self_attn", dtype, make_method, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if config.is_moe_layer(layer_index):
            self.mlp = _moe_block(config, f"{prefix}.mlp", dtype, make_method, tp, enable_expert_parallel)
        else:
            self.mlp = MLP(config, f"{prefix}.mlp", dtype, make_method, tp)
        if config.sandwich_norms:  # GLM-4-0414: each sub-block's output is normalized before the add
            self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        else:
            self.post_self_attn_layernorm = self.post_mlp_layernorm = None

    def forward(
        self,
        positions: torch.Tensor,  # int64 [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]: the residual stream before ``hidden`` is added
        rotary: RotaryEmbedding | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        lora: LoRAIndices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp_out, residual)``; the caller's next norm adds them. Carrying the residual
        this way lets each add ride inside the following norm's kernel."""
        store = self.self_attn.rotary_store(rotary, kv_cache, metadata, hidden.dtype)
        (query, key, value), residual = self.pre_attention(
            positions, hidden, residual, rotary, metadata.ntk_tables, lora, store
        )
        # [num_tokens, H, D]
        out = self.self_attn.attn(query, key, value, kv_cache, metadata, kv_stored=store is not None)
        return self.post_attention(out, residual, lora)

    def pre_attention(
        self,
        positions: torch.Tensor,  # int64 [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,  # [num_tokens, hidden] or None (the first layer)
        rotary: RotaryEmbedding | None,
        ntk_tables: torch.Tensor | None,  # int64 [num_tokens] or None
        lora: LoRAIndices | None = None,
        store: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,  # Attention.rotary_store's
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        """The layer up to the paged attention: ``((query, key, value), residual)``. ``forward`` is
        ``pre_attention``, the attention, ``post_attention``; piecewise CUDA graphs run the two
        halves in graphs and the attention between them eagerly (qserve.runner.piecewise_graphs),
        passing no ``store``: the pieces do not take the step's slots, the eager attention stores."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_and_norm(hidden, residual)
        return self.self_attn.project_qkv(positions, normed, rotary, ntk_tables, lora, store), residual

    def post_attention(
        self,
        out: torch.Tensor,  # [num_tokens, H, D]: the attention's output
        residual: torch.Tensor,  # [num_tokens, hidden]
        lora: LoRAIndices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after the paged attention: ``(mlp_out, residual)`` as ``forward`` returns."""
        attn_out = self.self_attn.project_out(out, lora)
        if self.post_self_attn_layernorm is not None:
            attn_out = self.post_self_attn_layernorm(attn_out)
        normed, residual = self.post_attention_layernorm.add_and_norm(attn_out, residual)
        mlp_out = self.mlp(normed, lora)
        if self.post_mlp_layernorm is not None:
            mlp_out = self.post_mlp_layernorm(mlp_out)
        return mlp_out, residual


class LlamaFamilyForCausalLM(nn.Module):
    """The decoder plus its LM head. Parameter names follow HF (``model.layers.0...``).

    With a ``tp`` group (qserve.distributed) the model is this rank's shard: vocabulary-parallel
    embedding and LM head, column/row-parallel linears, this rank's attention heads; the
    collectives run inside the forward, and ``compute_logits`` returns the full vocabulary on
    every rank. A mixture-of-experts layer holds the rank's routed experts: whole experts with
    ``enable_expert_parallel`` (vLLM's name), else a slice of every expert (``parallel_moe``).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        make_method: LinearMethodFactory,
        tp: TPGroup | None = None,
        enable_expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.model = nn.Module()
        self.model.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, f"model.layers.{i}", dtype, make_method, tp, i, enable_expert_parallel)
            for i in range(config.num_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = None if config.alibi else _rotary(config)
        self.qk_row_permutation = _qk_row_permutation(config)  # [head_dim] or None
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
        lora: LoRAIndices | None = None,  # each row's adapter slot (qserve.lora); None: the base model only
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self._run(input_ids, positions, kv_caches, metadata, lora, ())[0]

    def forward_with_taps(
        self,
        input_ids: torch.Tensor,  # int64 [num_tokens]
        positions: torch.Tensor,  # int64 [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        taps: tuple[int, ...],  # layer ids, each in [0, num_layers)
        lora: LoRAIndices | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s hidden states ``[num_tokens, hidden]`` and, concatenated in the order of
        ``taps``, the residual stream entering each tapped layer ``[num_tokens, len(taps) * hidden]``
        (layer 0's is the embeddings). EAGLE-3 heads read these (vLLM's aux hidden states)."""
        return self._run(input_ids, positions, kv_caches, metadata, lora, taps)

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
        lora: LoRAIndices | None,
        taps: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        streams: dict[int, torch.Tensor] = {}
        for index, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            if index in taps:  # the residual stream entering this layer
                streams[index] = hidden if residual is None else hidden + residual
            hidden, residual = layer(positions, hidden, residual, self.rotary, kv_cache, metadata, lora)
        tapped = torch.cat([streams[i] for i in taps], dim=-1) if taps else None  # [T, len(taps) * hidden]
        if residual is None:  # a model without layers
            return self.model.norm(hidden), tapped
        return self.model.norm.add_and_norm(hidden, residual)[0], tapped

    @property
    def supports_cuda_graphs(self) -> bool:
        """False when a MoE layer's experts run a path that syncs with the host (the default
        per-expert loop on CUDA); the engine then runs every step eagerly."""
        return all(m.graph_safe for m in self.modules() if isinstance(m, SparseMoeBlock))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> float32 [R, vocab]
        if self.lm_head is None and self.tp is not None:
            return self.model.embed_tokens.compute_logits(hidden).float()  # vocabulary-parallel, gathered
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------------------------------
    # Weight loading
    # ------------------------------------------------------------------------------------------

    def holds_weight(self, name: str) -> bool:
        """False for a checkpoint name (a quantized module's prefix or a tensor name) this model
        never stores: a routed expert that another expert-parallel rank holds. The loader skips
        such names without reading them."""
        expert = _EXPERT_TENSOR.match(name)
        if expert is None:
            return True
        try:
            block = self.get_submodule(expert.group(1))
        except AttributeError:  # not a module of this model: load_weights names it
            return True
        return not isinstance(block, SparseMoeBlock) or block.holds_expert(int(expert.group(2)))

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | PackedQuantWeight]],
        after_prepare: Callable[[Linear], None] | None = None,
    ) -> None:
        """Route checkpoint tensors (HF names) into this model; every weight must arrive.

        Dense tensors come as ``(param_name, tensor)``; quantized linears as
        ``(module_prefix, PackedQuantWeight)``. A linear layer's one-time work (fusing its shards, the
        kernel layout) runs as soon as its last shard arrives, so its canonical copies die beside the next
        layer's loads (issue 25); ``after_prepare`` is then called with the layer (the loader's weights
        pool).
        """
        linears = {name: m for name, m in self.named_modules() if isinstance(m, Linear)}
        moe_blocks = {name: m for name, m in self.named_modules() if isinstance(m, SparseMoeBlock)}
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
            expert = _EXPERT.match(module_path) if moe_blocks else None
            if expert is not None and expert.group(1) in moe_blocks:
                block = moe_blocks[expert.group(1)]
                if leaf == "bias":  # GPTQ v1's zero bias of a quantized expert (see below)
                    if not value.is_meta and bool((value != 0).any()):
                        raise ValueError(f"{name}: non-zero bias for an expert projection, which has none")
                    continue
                block.load_expert(int(expert.group(2)), expert.group(3), value, name)
                continue
            if self.qk_row_permutation is not None and sub in ("q_proj", "k_proj") and leaf in ("weight", "bias"):
                value = _permute_head_rows(value, self.qk_row_permutation, self.config.head_dim)
            if sub in _FUSED_SHARDS:
                layer_name, shard_id = f"{parent}.{_FUSED_SHARDS[sub][0]}", _FUSED_SHARDS[sub][1]
            else:
                layer_name, shard_id = module_path, 0
            if layer_name in linears and leaf == "bias" and linears[layer_name].bias is None:
                # GPTQ (auto-gptq v1) writes a bias for every quantized layer, zero where the
                # float model had none (Qwen v1 Int4): skip those, refuse a real one.
                # (On the meta device, `qserve inspect`'s dry load, there are no values to check.)
                if not value.is_meta and bool((value != 0).any()):
                    raise ValueError(f"{name}: non-zero bias for a layer that has none in {self.config.architecture}")
                continue
            if layer_name in linears and leaf in ("weight", "bias"):
                if leaf == "weight":
                    # the layer may be prepared already: a second copy is refused, never overwritten
                    if shard_id in loaded_shards[layer_name]:
                        raise ValueError(
                            f"{name}: the checkpoint holds this weight twice ({layer_name} shard {shard_id})"
                        )
                    linears[layer_name].load_weight(shard_id, value)
                    loaded_shards[layer_name].add(shard_id)
                    if len(loaded_shards[layer_name]) == len(linears[layer_name].output_sizes):
                        del value  # the canonical tensor this loop holds: freed before the prepared copy exists
                        linears[layer_name].process_after_loading()
                        if after_prepare is not None:
                            after_prepare(linears[layer_name])
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
        for block in moe_blocks.values():
            missing += block.missing()
        for layer_name, layer in linears.items():
            missing += [
                f"{layer_name} shard {i}" for i in range(len(layer.output_sizes)) if i not in loaded_shards[layer_name]
            ]
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")
        if self.config.lm_head_normalized:
            self._normalize_lm_head()
        for block in moe_blocks.values():
            block.process_after_loading()

    def _normalize_lm_head(self) -> None:
        """NormHead (Baichuan2): logits = x . normalize(W, dim=1)^T; rows normalized once here."""
        weight = getattr(self.lm_head, "weight", None) if self.lm_head is not None else None
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"{self.config.architecture}: a normalized lm_head must be stored unquantized")
        weight.data.copy_(F.normalize(weight.data.float(), dim=-1).to(weight.dtype))
