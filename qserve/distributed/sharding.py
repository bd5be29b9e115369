"""Which slice of every weight a tensor-parallel rank holds, and the slicing itself.

Knows: the partition rules (heads, KV heads, intermediate size, vocabulary) and how to cut a
dense ``[N, K]`` weight (torch orientation) or a canonical ``PackedQuantWeight`` (qweight int32
``[K/pf, N]``, scales / zeros ``[ng, N]``, perm ``[K]``) along N (column-parallel) or K
(row-parallel). Must not know: processes, collectives, checkpoint formats or modules. Every
function is a pure function of ``(rank, size)``, so the unit tests need no process group.

Rules (shared/docs/formats.md §5.3, P3, P4):

* Column-parallel (qkv, gate_up, lm_head): a plain slice along N of every output shard
  (q, k, v or gate, up separately). N is never packed in the canonical layout, so any N slice
  is exact; scales / zeros are sliced along N too, perm is kept whole (it indexes K).
* Row-parallel (o_proj, down_proj): rank ``r`` owns input rows ``[r*K/tp, (r+1)*K/tp)``.
  - no act-order: slice qweight rows and scale / zero groups; needs ``K/tp % group_size == 0``
    (else refused, naming the layer, K, group size and TP size). A per-channel weight (one
    group spanning K) keeps its one scale row on every rank and gets ``group_size = K/tp``.
  - act-order (perm present): groups are global, so every rank keeps the FULL scales and zeros
    and takes the packed rows whose ``perm`` value falls in its input range. Those rows belong
    to arbitrary groups, so they are laid out as *padded groups* (see ``row_shard_act_order``):
    a ``PackedQuantWeight`` whose perm indexes the local input, which
    ``quant_kernels.reference.w4a16_matmul`` computes exactly (padding rows are exactly 0).
    ``RowParallelLinear`` then hoists that perm out as an input gather, so the kernels only
    ever see a plain grouped weight (group size a multiple of 16).
* KV heads: split when ``num_kv_heads >= tp``; otherwise replicated, rank ``r`` uses KV head
  ``r // (tp / num_kv_heads)`` (formats.md §5.3, vLLM's rule).
* Vocabulary: rank ``r`` owns ids ``[r*chunk, min((r+1)*chunk, V))`` with ``chunk = ceil(V/tp)``.
* Routed experts of a MoE layer (``ExpertShard``; the router is replicated): with expert
  parallelism (vLLM's ``enable_expert_parallel``) rank ``r`` holds whole experts
  ``[r*E/tp, (r+1)*E/tp)`` (contiguous blocks: expert ``e`` lives on rank ``e // (E/tp)``);
  without it every rank holds every expert, each split like a dense MLP (gate / up
  column-parallel, down row-parallel over the expert's intermediate size).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from qserve.config import ModelConfig
from quant_kernels.layout import PackedQuantWeight, pack_codes, pack_factor, unpack_codes

# Padded act-order groups are rounded up to this many rows: a multiple of every pack factor, and
# a size the W4A16 kernel serves (its K-tiles take groups of 48 or 80 rows as runs of 16 inside one
# group: quant_kernels.w4a16_mma_triton._group_params).
ACT_ORDER_GROUP_ALIGN = 16

Weight = torch.Tensor | PackedQuantWeight


def split_evenly(total: int, size: int, what: str) -> int:
    """``total / size``, refusing a remainder with a message naming ``what``."""
    if total % size:
        raise ValueError(f"{what}={total} is not divisible by tensor_parallel_size={size}")
    return total // size


@dataclass(frozen=True, slots=True)
class AttentionShard:
    """The heads one rank computes: query heads ``[q_head_start, +num_heads)`` and KV heads
    ``[kv_head_start, +num_kv_heads)`` of the full model."""

    num_heads: int
    num_kv_heads: int
    q_head_start: int
    kv_head_start: int

    def qkv_slices(self, head_dim: int) -> list[tuple[int, int]]:
        """(start, size) along N of the q, k and v output shards."""
        kv = (self.kv_head_start * head_dim, self.num_kv_heads * head_dim)
        return [(self.q_head_start * head_dim, self.num_heads * head_dim), kv, kv]


def attention_shard(num_heads: int, num_kv_heads: int, rank: int, size: int) -> AttentionShard:
    heads = split_evenly(num_heads, size, "num_attention_heads")
    if num_kv_heads >= size:
        kv_heads = split_evenly(num_kv_heads, size, "num_key_value_heads")
        return AttentionShard(heads, kv_heads, rank * heads, rank * kv_heads)
    if size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads={num_kv_heads} < tensor_parallel_size={size} needs tensor_parallel_size to be a "
            "multiple of it (each KV head is replicated on tensor_parallel_size / num_key_value_heads ranks)"
        )
    return AttentionShard(heads, 1, rank * heads, rank // (size // num_kv_heads))


def vocab_shard(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, rows held, chunk): rank ``rank`` owns ids ``[start, start + rows)``; every rank's
    table is padded to ``chunk`` rows so that gathered logits line up."""
    chunk = math.ceil(vocab_size / size)
    start = min(rank * chunk, vocab_size)
    return start, min(chunk, vocab_size - start), chunk


def per_rank_config(config: ModelConfig, tp_size: int, enable_expert_parallel: bool = False) -> ModelConfig:
    """``config`` with the per-rank head and intermediate counts (sizes of one rank's KV cache,
    activations and attention); vocabulary, hidden size and the number of experts (every rank
    routes over all of them) stay global. A MoE model's shared expert is split like a dense MLP,
    its routed experts' ``moe_intermediate_size`` unless ``enable_expert_parallel`` (whole
    experts per rank; ``expert_shard`` checks the expert count). tp_size 1: unchanged."""
    if tp_size == 1:
        return config
    shard = attention_shard(config.num_heads, config.num_kv_heads, 0, tp_size)
    moe = {}
    if config.moe_layers:
        experts = expert_shard(config.num_experts, config.moe_intermediate_size, 0, tp_size, enable_expert_parallel)
        moe = {
            "moe_intermediate_size": experts.intermediate_size,
            "shared_expert_intermediate_size": split_evenly(
                config.shared_expert_intermediate_size, tp_size, "shared_expert_intermediate_size"
            ),
        }
    return dataclasses.replace(
        config,
        num_heads=shard.num_heads,
        num_kv_heads=shard.num_kv_heads,
        intermediate_size=split_evenly(config.intermediate_size, tp_size, "intermediate_size"),
        **moe,
    )


# ----------------------------------------------------------------------------------------------
# Routed experts: whole experts per rank (expert parallel) or every expert split
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """The routed experts of one MoE layer a rank holds: experts ``[expert_start,
    +num_local_experts)`` of ``num_experts``, each one's intermediate rows ``[intermediate_start,
    +intermediate_size)`` of ``full_intermediate_size``."""

    expert_parallel: bool
    num_experts: int
    expert_start: int
    num_local_experts: int
    full_intermediate_size: int
    intermediate_start: int
    intermediate_size: int

    def holds(self, expert: int) -> bool:
        return self.expert_start <= expert < self.expert_start + self.num_local_experts


def expert_shard(num_experts: int, intermediate_size: int, rank: int, size: int, expert_parallel: bool) -> ExpertShard:
    """Rank ``rank``'s routed experts (see ``ExpertShard``); an uneven split is refused by name."""
    if expert_parallel:
        if num_experts % size:
            raise ValueError(
                f"num_experts={num_experts} is not divisible by tensor_parallel_size={size}: expert parallelism "
                "(--enable-expert-parallel) gives every rank the same number of whole experts; use a tensor_parallel_size "
                "that divides num_experts, or leave expert parallelism off (each expert split across ranks)"
            )
        local = num_experts // size
        return ExpertShard(True, num_experts, rank * local, local, intermediate_size, 0, intermediate_size)
    if intermediate_size % size:
        raise ValueError(
            f"moe_intermediate_size={intermediate_size} is not divisible by tensor_parallel_size={size}: without "
            "expert parallelism every expert is split across the ranks; use --enable-expert-parallel (whole experts "
            "per rank) or another tensor_parallel_size"
        )
    inter = intermediate_size // size
    return ExpertShard(False, num_experts, 0, num_experts, intermediate_size, rank * inter, inter)


def expert_weight_shard(weight: Weight, proj: int, shard: ExpertShard, rank: int, size: int, name: str) -> Weight:
    """The rank's part of one held expert's gate (``proj`` 0) / up (1) / down (2) weight: the
    whole weight with expert parallelism, else the gate / up output rows or the down input rows
    of ``shard``'s intermediate slice. A split act-order down is refused (its padded groups
    differ per expert, which one stacked tensor cannot hold)."""
    if shard.expert_parallel:
        return weight
    full, start, local = shard.full_intermediate_size, shard.intermediate_start, shard.intermediate_size
    if proj < 2:
        return column_shard(weight, start, local, full, name)
    if isinstance(weight, PackedQuantWeight) and weight.perm is not None:
        raise ValueError(
            f"{name}: an act-order (desc_act) expert down projection cannot be split over tensor_parallel_size={size}; "
            "use --enable-expert-parallel (whole experts per rank)"
        )
    try:
        return row_shard(weight, rank, size, full, name)
    except ValueError as err:
        raise ValueError(f"{err}; or use --enable-expert-parallel (whole experts per rank)") from err


# ----------------------------------------------------------------------------------------------
# Column-parallel: slice N
# ----------------------------------------------------------------------------------------------


def column_shard(weight: Weight, start: int, size: int, full_size: int, name: str) -> Weight:
    """Rows ``[start, start+size)`` of a dense ``[N, K]`` weight / columns of a packed ``[K/pf, N]``."""
    n = weight.out_features if isinstance(weight, PackedQuantWeight) else weight.shape[0]
    if n != full_size:
        raise ValueError(f"{name}: checkpoint has N={n} outputs, the config says {full_size}")
    if not isinstance(weight, PackedQuantWeight):
        return weight[start : start + size]  # [size, K]
    cols = slice(start, start + size)
    return PackedQuantWeight(
        bits=weight.bits,
        group_size=weight.group_size,
        qweight=weight.qweight[:, cols].contiguous(),  # int32 [K/pf, size]
        scales=weight.scales[:, cols].contiguous(),  # [ng, size]
        zeros=None if weight.zeros is None else weight.zeros[:, cols].contiguous(),  # uint8 [ng, size]
        perm=weight.perm,  # int64 [K], indexes K: unchanged
    )


# ----------------------------------------------------------------------------------------------
# Row-parallel: slice K
# ----------------------------------------------------------------------------------------------


def row_shard(weight: Weight, rank: int, size: int, full_in_features: int, name: str) -> Weight:
    """The rank's input rows ``[rank*K/size, (rank+1)*K/size)`` of a dense or packed weight."""
    k = weight.in_features if isinstance(weight, PackedQuantWeight) else weight.shape[1]
    if k != full_in_features:
        raise ValueError(f"{name}: checkpoint has K={k} inputs, the config says {full_in_features}")
    k_local = split_evenly(k, size, f"{name}: input size K")
    if not isinstance(weight, PackedQuantWeight):
        return weight[:, rank * k_local : (rank + 1) * k_local]  # [N, K/tp]
    if weight.perm is not None:
        return row_shard_act_order(weight, rank, size, name)
    return _row_shard_grouped(weight, rank, size, k_local, name)


def _row_shard_grouped(weight: PackedQuantWeight, rank: int, size: int, k_local: int, name: str) -> PackedQuantWeight:
    pf, g, k = pack_factor(weight.bits), weight.group_size, weight.in_features
    if k_local % pf:
        raise ValueError(
            f"{name}: K={k} split over tensor_parallel_size={size} gives {k_local} input rows per rank, not a "
            f"multiple of the {pf} codes packed per int32 word"
        )
    rows = slice(rank * k_local // pf, (rank + 1) * k_local // pf)
    if weight.num_groups == 1:  # per-channel: the one scale row serves every input row
        return PackedQuantWeight(weight.bits, k_local, weight.qweight[rows].contiguous(), weight.scales, weight.zeros)
    if k_local % g:
        raise ValueError(
            f"{name}: row-parallel split of K={k} over tensor_parallel_size={size} gives {k_local} input rows per "
            f"rank, which is not a multiple of the group size {g}; the scales' groups would straddle ranks "
            "(formats.md P4: use a smaller tensor_parallel_size or a checkpoint padded for it)"
        )
    groups = slice(rank * k_local // g, (rank + 1) * k_local // g)
    return PackedQuantWeight(
        bits=weight.bits,
        group_size=g,
        qweight=weight.qweight[rows].contiguous(),  # int32 [K/tp/pf, N]
        scales=weight.scales[groups].contiguous(),  # [ng/tp, N]
        zeros=None if weight.zeros is None else weight.zeros[groups].contiguous(),  # uint8 [ng/tp, N]
    )


def row_shard_act_order(weight: PackedQuantWeight, rank: int, size: int, name: str) -> PackedQuantWeight:
    """Row-parallel shard of an act-order weight, as *padded groups*.

    The rank owns original input rows ``[lo, hi)``; in packed (group-sorted) order those rows are
    scattered over every group ``g`` (packed row ``k`` is in group ``k // G``). Let ``c_g`` be how
    many of the rank's rows fall in group ``g`` and ``Gp = roundup(max_g c_g, 16)``. The shard is a
    ``PackedQuantWeight`` with ``num_groups * Gp`` packed rows and ``group_size = Gp``: block ``g``
    holds the rank's ``c_g`` rows of global group ``g`` (codes copied, in packed order) followed by
    ``Gp - c_g`` padding rows whose code equals the group's zero point, so they dequantize to
    exactly 0. ``scales`` / ``zeros`` are the FULL ``[num_groups, N]`` tensors (groups are global),
    and ``perm`` maps each packed row to its column of the rank's local input (``perm[k] - lo``;
    padding rows point at column 0, which they multiply by 0). So
    ``reference.w4a16_matmul(x_local, shard)`` sums exactly the rank's terms of the full product;
    the row-parallel all-reduce adds the ranks up. The padding costs ``Gp * num_groups - K/tp``
    code rows (a few percent); scales and zeros are replicated, as in vLLM.
    """
    k, g, bits = weight.in_features, weight.group_size, weight.bits
    k_local = split_evenly(k, size, f"{name}: input size K")
    lo, hi = rank * k_local, (rank + 1) * k_local
    perm = weight.perm  # int64 [K]
    codes = unpack_codes(weight.qweight, bits)  # int32 [K, N]
    rows = ((perm >= lo) & (perm < hi)).nonzero().flatten()  # [K/tp] packed rows, ascending
    groups = rows // g  # [K/tp], non-decreasing
    num_groups = weight.num_groups
    counts = torch.bincount(groups, minlength=num_groups)  # [ng]
    padded_group = max(int(counts.max()), 1)
    padded_group = -(-padded_group // ACT_ORDER_GROUP_ALIGN) * ACT_ORDER_GROUP_ALIGN
    first = torch.cumsum(counts, 0) - counts  # [ng] index in `rows` of each group's first row
    slots = groups * padded_group + (torch.arange(rows.numel(), device=rows.device) - first[groups])  # [K/tp]
    if weight.zeros is None:
        fill = torch.full_like(weight.scales, 1 << (bits - 1), dtype=torch.int32)  # [ng, N]
    else:
        fill = weight.zeros.to(torch.int32)
    padded_codes = fill.repeat_interleave(padded_group, dim=0)  # int32 [ng * Gp, N], codes == zero point
    padded_codes[slots] = codes[rows]
    local_perm = torch.zeros(num_groups * padded_group, dtype=torch.int64, device=perm.device)  # [ng * Gp]
    local_perm[slots] = perm[rows] - lo
    return PackedQuantWeight(
        bits=bits,
        group_size=padded_group,
        qweight=pack_codes(padded_codes, bits),  # int32 [ng * Gp / pf, N]
        scales=weight.scales,  # [ng, N] full
        zeros=weight.zeros,  # uint8 [ng, N] full, or None
        perm=local_perm,
    )
