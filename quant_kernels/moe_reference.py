"""Pure-PyTorch mixture-of-experts ops: routing, the expert MLPs, the token sort by expert.

Knows: top-k softmax routing (optionally renormalized), the SwiGLU expert MLP
(``down(silu(gate(x)) * up(x))``) over stacked expert weights (``quant_kernels.moe_layout``, or
dense ``[E, N, K]`` tensors), and the sort of (token, slot) pairs by expert into ``BLOCK_M``-padded
groups that a grouped GEMM tiles (``moe_align_block_size``, the oracle of the one-launch Triton
sort that the fused path runs, ``moe_triton.moe_align_block_size``), and the sort-free layout of the
same contract that gives each pair a block of its own (``direct_block_layout``, the oracle of the
router's opt-in layout, ``moe_router_triton.router_topk_blocks``). Must not know: models,
checkpoint formats, engines.

``fused_moe_w4a16`` and ``fused_moe_dense`` are the CPU path of the engine and the oracle of the
Triton kernel (``quant_kernels.moe_triton``, same signature). They loop over the experts that
the step hits (a host sync to learn which: fine on CPU) and add each expert's weighted output
into its tokens in ascending expert order, as transformers' MoE blocks do, so that a float32 CPU
run reproduces them bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quant_kernels import reference
from quant_kernels.moe_layout import StackedQuantWeight


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], int32 expert ids [T, k]): softmax in float32, top-k, and with
    ``renormalize`` the k weights scaled to sum to one (Mixtral always; Qwen MoE iff
    ``norm_topk_prob``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def local_expert_ids(
    topk_ids: torch.Tensor,  # int [T, k], global expert ids
    expert_start: int,
    num_local_experts: int,
) -> torch.Tensor:  # int32 [T, k]
    """Expert parallelism: the ids of a rank holding experts ``[expert_start, +num_local_experts)``
    as indices into its own stack; a pair routed to another rank's expert gets the sentinel
    ``num_local_experts``, which every op here skips (it contributes zero on this rank)."""
    local = topk_ids.to(torch.int32) - expert_start  # [T, k]
    foreign = (local < 0) | (local >= num_local_experts)
    return torch.where(foreign, num_local_experts, local)


def max_padded_rows(num_pairs: int, num_groups: int, block_m: int) -> int:
    """The rows ``moe_align_block_size`` returns: every pair plus, in each of at most
    ``min(num_pairs, num_groups)`` non-empty groups, up to ``block_m - 1`` rows of padding, rounded
    up to whole blocks. From the shapes alone, so it needs no host sync."""
    rows = num_pairs + min(num_pairs, num_groups) * (block_m - 1)
    return -(-rows // block_m) * block_m


def moe_align_block_size(
    topk_ids: torch.Tensor,  # int [T, k]
    num_experts: int,
    block_m: int,
    skip_foreign: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T * k`` (token, slot) pairs by expert into groups padded to ``block_m`` rows.

    Returns ``sorted_ids`` int32 ``[max_padded]``: flat pair indices ``t * k + slot``, each
    expert's pairs contiguous (in pair order) and its group padded with the sentinel ``T * k``;
    ``expert_ids`` int32 ``[max_padded // block_m]``: the expert of each ``block_m`` block (blocks
    past the end repeat the last one and are never computed); ``num_padded`` int32 ``[1]``: the
    rows in use. ``max_padded = T*k + min(T*k, E) * (block_m - 1)`` rounded up to ``block_m``:
    known from the shapes alone, so the whole sort is torch ops on the device with no host sync
    (CUDA-graph safe: bincount would sync, so counts come from ``scatter_add``). About 20 launches
    on a GPU: the fused kernel's path runs ``moe_triton.moe_align_block_size`` instead (one launch,
    the same three tensors element for element; tested against this one).

    ``skip_foreign`` (expert parallelism): ids may also be the sentinel ``num_experts`` of
    ``local_expert_ids``; those pairs sort into one more group placed after every expert's, past
    ``num_padded``, so no block computes them.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [n]
    num_pairs = flat.numel()
    num_groups = num_experts + 1 if skip_foreign else num_experts  # the sentinel's group last
    max_padded = max_padded_rows(num_pairs, num_groups, block_m)
    counts = torch.zeros(num_groups, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )  # [E (+1)]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    ends = torch.cumsum(padded, 0)  # [E]
    starts = ends - padded  # [E]
    order = torch.argsort(flat, stable=True)  # [n]: pairs grouped by expert, pair order kept
    expert_of = flat[order]  # [n]
    first_of_expert = torch.cumsum(counts, 0) - counts  # [E]: index in `order` of each expert's first pair
    rank = torch.arange(num_pairs, device=device) - first_of_expert[expert_of]  # [n]
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[starts[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)  # [num_blocks]
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp(max=num_experts - 1).to(torch.int32)
    num_padded = ends[num_experts - 1 : num_experts].to(torch.int32)  # [1]: the sentinel's group lies past it
    return sorted_ids, expert_ids, num_padded


@dataclass(frozen=True)
class BlockLayout:
    """The pairs laid out in ``block_m``-row blocks of one expert each, as a grouped GEMM tiles them:
    ``moe_align_block_size``'s three tensors (its docstring is the contract) and the ``block_m`` they
    were built for (a GEMM tiling other blocks must not read them). Plain tensors and an int."""

    sorted_ids: torch.Tensor  # int32 [num_blocks * block_m]: flat pair indices, sentinel T*k = padding
    expert_ids: torch.Tensor  # int32 [num_blocks]: each block's expert (blocks past num_padded: never computed)
    num_padded: torch.Tensor  # int32 [1]: the rows in use
    block_m: int


def direct_block_layout(
    topk_ids: torch.Tensor,  # int [T, k]
    num_experts: int,
    block_m: int,
    skip_foreign: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align_block_size``'s contract without the sort: every pair gets a ``block_m`` block of its
    own (vLLM's naive block assignment), its index in the block's first row, the sentinel ``T * k`` in
    the rest, the block's expert its id. Valid for the grouped GEMMs because each row of a block is
    computed on its own and a token routes to an expert at most once; it costs one read of an expert's
    weights per pair instead of per hit expert, so it only pays while the sort's launch costs more
    than those reads (a handful of tokens).

    Blocks go in pair order, so with every expert local block ``i`` is pair ``i``; with
    ``skip_foreign`` (ids may be ``local_expert_ids``' sentinel ``num_experts``) the local pairs'
    blocks come first, in pair order, and ``num_padded`` ends after them, so no block computes a
    foreign pair (the others' blocks hold only the sentinel and expert ``num_experts - 1``, unread).
    Returns ``sorted_ids`` int32 ``[T*k*block_m]``, ``expert_ids`` int32 ``[T*k]``, ``num_padded``
    int32 ``[1]``: shapes from T and k only, torch ops with no host sync."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [n]
    num_pairs = flat.numel()
    local = flat < num_experts if skip_foreign else torch.ones_like(flat, dtype=torch.bool)  # [n]
    block_of = torch.empty_like(flat)  # [n]: each pair's block
    block_of[torch.argsort((~local).to(torch.int8), stable=True)] = torch.arange(num_pairs, device=device)
    pairs = torch.arange(num_pairs, dtype=torch.int32, device=device)  # [n]
    sorted_ids = torch.full((num_pairs * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[block_of * block_m] = torch.where(local, pairs, num_pairs)
    expert_ids = torch.empty(num_pairs, dtype=torch.int32, device=device)  # [n]
    expert_ids[block_of] = flat.clamp(max=num_experts - 1).to(torch.int32)
    num_padded = (local.sum(dtype=torch.int32) * block_m).reshape(1)  # [1]
    return sorted_ids, expert_ids, num_padded


ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, x [c, H]) -> [c, H]


def moe_loop(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
    expert_mlp: ExpertMLP,
    num_experts: int | None = None,
) -> torch.Tensor:  # [T, H]
    """Per hit expert: its tokens through ``expert_mlp``, times their routing weight, added into
    the output in ascending expert order. One host sync (which experts are hit). Pairs whose id
    is ``num_experts`` or more (``local_expert_ids``' sentinel: another rank's expert) are skipped."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    hit, counts = torch.unique_consecutive(flat[order], return_counts=True)
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(hit.tolist(), counts.tolist()):
        pairs = order[start : start + count]  # [c]: flat (token, slot) indices
        start += count
        if num_experts is not None and expert >= num_experts:
            break  # the sentinel sorts last
        tokens = pairs // top_k  # [c]
        y = expert_mlp(expert, x[tokens])  # [c, H]
        y = y * topk_weights.reshape(-1)[pairs, None].to(y.dtype)
        out.index_add_(0, tokens, y.to(out.dtype))
    return out


def fused_moe_w4a16(
    x: torch.Tensor,  # [T, H]
    w_gate_up: StackedQuantWeight,  # E experts of K=H, N=2I (gate | up)
    w_down: StackedQuantWeight,  # E experts of K=I, N=H
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
) -> torch.Tensor:  # [T, H]
    """The SwiGLU experts over 4/8-bit stacked weights, through ``reference.w4a16_matmul``."""
    inter = w_down.in_features

    def mlp(expert: int, xe: torch.Tensor) -> torch.Tensor:
        gate_up = reference.w4a16_matmul(xe, w_gate_up.expert(expert))  # [c, 2I]
        return reference.w4a16_matmul(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down.expert(expert))

    return moe_loop(x, topk_weights, topk_ids, mlp, w_gate_up.num_experts)


def fused_moe_dense(
    x: torch.Tensor,  # [T, H]
    w_gate_up: torch.Tensor,  # [E, 2I, H] (torch orientation, gate rows first)
    w_down: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
) -> torch.Tensor:  # [T, H]
    """The SwiGLU experts over unquantized stacked weights."""
    inter = w_down.shape[-1]

    def mlp(expert: int, xe: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(xe, w_gate_up[expert])  # [c, 2I]
        return F.linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w_down[expert])

    return moe_loop(x, topk_weights, topk_ids, mlp, w_gate_up.shape[0])
