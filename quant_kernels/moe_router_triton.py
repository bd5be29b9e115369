"""Triton router top-k for mixture-of-experts layers: softmax over the router logits, the top k
experts, their weights renormalized when the family asks, in one launch; optionally with the router's
logits GEMM in the same launch.

Knows: the router's logits as ``F.linear(hidden, weight)`` in the model dtype (transformers'), the
contract of ``moe_reference.select_experts`` (float32 weights ``[T, k]`` in descending order, int32
ids ``[T, k]``; softmax in float32; ``renormalize`` scales the k weights to sum to one),
``moe_reference.local_expert_ids``' sentinel, and the block layout contract of
``moe_reference.direct_block_layout`` (the token sort's three tensors, one pair per block). Must not
know: models, layers, the expert kernels that consume the ids and blocks (their ``block_m`` is an
argument). Imported lazily (CUDA, or the CPU tests under TRITON_INTERPRET=1).

Why: the reference is about six launches per MoE layer (the float cast, softmax, topk, sum, divide,
the int32 cast). A decode step of one sequence replays each as a graph node of a few µs and does
almost no work in any of them; on Qwen3-30B-A3B's 48 MoE layers that is ~240 of a step's launches.

``router_topk_kernel``: program ``t`` owns token row ``t``: it loads the row's E logits (E padded to a
power of two, masked), takes the float32 softmax, then picks the k largest by k rounds of argmax
(ties go to the lower expert id), masking each pick; the picks and their weights stay in registers
(``[K_PAD]`` vectors), are renormalized if asked and stored once. The grid is ``(T,)``: no host sync,
CUDA-graph safe.

``router_topk_blocks_kernel`` (steps of at most ``QSERVE_MOE_DIRECT_BLOCKS`` pairs, default 32, read
in ``quant_kernels.moe_ops``): the same choice for a handful of tokens, plus what the token sort would
otherwise compute in a launch of its own (~3.5 µs at decode on the H200): the ids as one expert-parallel
rank's (``local_expert_ids``) and the grouped GEMM's blocks with one pair each
(``direct_block_layout``). One program holds all ``[T_PAD, BLOCK_E]`` logits: a pair's block is its
rank among the local pairs of every token, which a per-token program could not know. Local pairs'
blocks first in pair order, then the foreign ones' (all sentinel); every row of ``sorted_ids`` is
written by one store (the first rows of blocks and their padding at distinct addresses), so no
barrier orders two stores. Grid ``(1,)``, outputs sized from T, k and ``block_m``: no host sync.

``router_gemm_topk_blocks_kernel`` (the default; ``QSERVE_FUSED_ROUTER_GEMM=0`` opts out, read in
``quant_kernels.moe_ops.route_hidden``): the router's logits too, so a decode step's MoE layer launches
one kernel before its experts instead of two (the cuBLAS router GEMM, ~5 µs for Qwen3-30B-A3B's
128 x 2048 fp16 router at one token on the H200, then the kernel above): 48 fewer graph nodes a step on
Qwen3-30B-A3B. Grid ``(cdiv(E, BLOCK_EG),)``: each program reads ``BLOCK_EG`` router rows
(``ROUTER_GEMM_PROGRAMS`` programs share the weight read) and computes their logits for all ``T_PAD``
tokens (fp32 FMAs: T is a handful, no tensor cores), rounds them to the model dtype (as F.linear's
output; the choice then reads the same values as the two launches', up to the fp32 sum's order) and
stores them into a ``[T, E]`` buffer; the program that arrives last on an int32 counter
(``arrival_counter``: moe_mma_triton's split-K pattern, a barrier then an acq_rel atomic, ``.cg``
loads, reset by that program for the next launch and graph replay) runs the same choice and layout
as ``router_topk_blocks_kernel`` (one ``@triton.jit`` helper, ``_topk_blocks_store``) on all the
``[T_PAD, BLOCK_E]`` logits. No host sync, CUDA-graph safe
(untuned: ``ROUTER_GEMM_PROGRAMS``, 4 warps where the top-k above runs in one at decode).
With ``QSERVE_ENABLE_PDL=1`` (``quant_kernels.pdl``) it launches with PDL: each program prefetches its
router rows into L2 (read-only weights) before it waits for the norm that makes ``hidden``. With
``QSERVE_MOE_PACKED_TOPK`` (on by default, ``packed_topk_requested``; ``=0`` off) its last program picks each of the k
experts with one max over packed (probability, id) keys instead of a max and a min: the top-k's rounds
are its serial tail (8 rounds of cross-warp reductions; the launch took 5.9 µs a layer at batch 1 on the
H200, 2026-12-07).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quant_kernels import device as kdevice
from quant_kernels.pdl import launch_options
from quant_kernels.w4a16_mma_triton import _prefetch_l2


@triton.jit
def router_topk_kernel(
    logits_ptr,  # [T, E] fp16 / bf16 / fp32
    weights_ptr,  # float32 [T, k]
    ids_ptr,  # int32 [T, k]
    num_experts, stride_t,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + t * stride_t + experts, mask=valid, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, 0)
    e = tl.where(valid, tl.exp(x), 0.0)
    probs = e / tl.sum(e, 0)  # [BLOCK_E]
    left = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks a padded or picked expert
    slots = tl.arange(0, K_PAD)
    picked_w = tl.zeros((K_PAD,), dtype=tl.float32)
    picked_id = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        best_id = tl.min(tl.where(left == best, experts, BLOCK_E), 0)  # the lowest id among ties
        picked_w = tl.where(slots == j, best, picked_w)
        picked_id = tl.where(slots == j, best_id, picked_id)
        left = tl.where(experts == best_id, -1.0, left)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots < TOP_K, picked_w, 0.0), 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, picked_w, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, picked_id, mask=keep)


@triton.jit
def _topk_blocks_store(
    x,  # float32 [T_PAD, BLOCK_E] logits; padded rows finite (never stored), padded columns anything
    weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    num_tokens, num_experts, expert_start, num_local,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    PACKED: tl.constexpr = False,  # QSERVE_MOE_PACKED_TOPK: one max per round over packed (prob, id) keys
):  # fmt: skip
    """The choice and the one-pair-per-block layout of ``router_topk_blocks_kernel``, from logits already
    in registers: the one implementation that kernel and ``router_gemm_topk_blocks_kernel``'s last
    program share (Triton inlines it). ``PACKED``: each round's pick is one max over int64 keys (the
    probability's bits above ``BLOCK_E - 1 - id``: probabilities are >= 0, so their bits order as
    integers, and the largest key is the largest probability with the lowest id among ties; picked and
    padded experts' -1.0 makes a negative key) instead of a max and then a min over the tied ids: half
    the cross-warp reductions of the top-k's rounds, the same picks."""
    rows = tl.arange(0, T_PAD)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens  # [T_PAD]
    col_ok = experts < num_experts  # [BLOCK_E]
    x = tl.where(col_ok[None, :], x, float("-inf"))
    x = x - tl.max(x, 1)[:, None]
    e = tl.where(col_ok[None, :], tl.exp(x), 0.0)
    probs = e / tl.sum(e, 1)[:, None]  # [T_PAD, BLOCK_E]
    left = tl.where(col_ok[None, :], probs, -1.0)  # -1 marks a padded or picked expert, as router_topk_kernel
    slots = tl.arange(0, K_PAD)
    picked_w = tl.zeros((T_PAD, K_PAD), dtype=tl.float32)
    picked_id = tl.zeros((T_PAD, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        if PACKED:
            key = (left.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - experts)[None, :].to(tl.int64)
            top = tl.max(key, 1)  # [T_PAD] int64
            best_id = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
            best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        else:
            best = tl.max(left, 1)  # [T_PAD]
            best_id = tl.min(tl.where(left == best[:, None], experts[None, :], BLOCK_E), 1)  # the lowest id among ties
        picked_w = tl.where(slots[None, :] == j, best[:, None], picked_w)
        picked_id = tl.where(slots[None, :] == j, best_id[:, None], picked_id)
        left = tl.where(experts[None, :] == best_id[:, None], -1.0, left)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots[None, :] < TOP_K, picked_w, 0.0), 1)[:, None]
    pair_ok = row_ok[:, None] & (slots < TOP_K)[None, :]  # [T_PAD, K_PAD]
    pairs = rows[:, None] * TOP_K + slots[None, :]  # [T_PAD, K_PAD] flat pair indices
    local = picked_id - expert_start
    foreign = (local < 0) | (local >= num_local)
    local = tl.where(foreign, num_local, local)  # local_expert_ids (identity when one rank holds all)
    tl.store(weights_ptr + pairs, picked_w, mask=pair_ok)
    tl.store(ids_ptr + pairs, local, mask=pair_ok)
    # A pair's block: local pairs first, in pair order (an exclusive count of the local pairs before it:
    # the earlier tokens' by a cumsum over rows, then its own row's), the foreign pairs after them.
    num_pairs = num_tokens * TOP_K
    is_local = (pair_ok & ~foreign).to(tl.int32)  # [T_PAD, K_PAD]
    is_foreign = (pair_ok & foreign).to(tl.int32)
    local_per_row = tl.sum(is_local, 1)  # [T_PAD]
    foreign_per_row = tl.sum(is_foreign, 1)
    num_local_pairs = tl.sum(local_per_row, 0)
    local_rank = (tl.cumsum(local_per_row, 0) - local_per_row)[:, None] + tl.cumsum(is_local, 1) - is_local
    foreign_rank = (tl.cumsum(foreign_per_row, 0) - foreign_per_row)[:, None] + tl.cumsum(is_foreign, 1) - is_foreign
    block = tl.where(foreign, num_local_pairs + foreign_rank, local_rank)  # [T_PAD, K_PAD]: a permutation of the pairs
    tl.store(expert_ids_ptr + block, tl.minimum(local, num_local - 1), mask=pair_ok)  # foreign: valid, never read
    offs_m = tl.arange(0, BLOCK_M)
    first = (offs_m == 0)[None, None, :] & (~foreign)[:, :, None]  # [T_PAD, K_PAD, BLOCK_M]
    tl.store(
        sorted_ids_ptr + block[:, :, None] * BLOCK_M + offs_m[None, None, :],
        tl.where(first, pairs[:, :, None], num_pairs),
        mask=pair_ok[:, :, None],
    )
    tl.store(num_padded_ptr, num_local_pairs * BLOCK_M)


@triton.jit
def router_topk_blocks_kernel(
    logits_ptr,  # [T, E] fp16 / bf16 / fp32
    weights_ptr,  # float32 [T, k]
    ids_ptr,  # int32 [T, k]: ids into the rank's experts, foreign ones the sentinel num_local
    sorted_ids_ptr,  # int32 [T*k*BLOCK_M]
    expert_ids_ptr,  # int32 [T*k]
    num_padded_ptr,  # int32 [1]
    num_tokens, num_experts, stride_t, expert_start, num_local,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= TOP_K
    T_PAD: tl.constexpr,  # next power of two >= num_tokens
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    BLOCK_M: tl.constexpr,  # the grouped GEMM's rows per block
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    rows = tl.arange(0, T_PAD)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_tokens  # [T_PAD]
    col_ok = experts < num_experts  # [BLOCK_E]
    x = tl.load(
        logits_ptr + rows[:, None] * stride_t + experts[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
    ).to(tl.float32)  # [T_PAD, BLOCK_E]; padded rows read zeros: a finite softmax, never stored
    _topk_blocks_store(
        x, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        num_tokens, num_experts, expert_start, num_local, TOP_K, K_PAD, T_PAD, BLOCK_E, BLOCK_M, RENORMALIZE,
    )  # fmt: skip


@triton.jit
def router_gemm_topk_blocks_kernel(
    hidden_ptr,  # [T, H] fp16 / bf16 / fp32, unit stride along H
    router_ptr,  # [E, H] the router's weight, hidden's dtype, unit stride along H
    logits_ptr,  # [T, E] hidden's dtype: each program writes its experts' columns, the last reads them all
    cnt_ptr,  # int32 [1] arrival counter, zero between launches (the last program resets it)
    weights_ptr,  # float32 [T, k]
    ids_ptr,  # int32 [T, k]: ids into the rank's experts, foreign ones the sentinel num_local
    sorted_ids_ptr,  # int32 [T*k*BLOCK_M]
    expert_ids_ptr,  # int32 [T*k]
    num_padded_ptr,  # int32 [1]
    num_tokens, num_experts, hidden_size, stride_ht, stride_re, stride_lt, expert_start, num_local,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= TOP_K
    T_PAD: tl.constexpr,  # next power of two >= num_tokens
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    BLOCK_EG: tl.constexpr,  # experts (router rows) per program
    BLOCK_H: tl.constexpr,  # hidden columns per step of the dot products
    BLOCK_M: tl.constexpr,  # the grouped GEMM's rows per block
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL (quant_kernels.pdl)
    PDL_ROW_BYTES: tl.constexpr = 0,  # > 0: each router row's bytes, prefetched into L2 before the wait
    PACKED_TOPK: tl.constexpr = False,  # QSERVE_MOE_PACKED_TOPK=1 (_topk_blocks_store's PACKED)
):  # fmt: skip
    pid = tl.program_id(0)
    rows = tl.arange(0, T_PAD)
    row_ok = rows < num_tokens  # [T_PAD]
    group = pid * BLOCK_EG + tl.arange(0, BLOCK_EG)  # [BLOCK_EG] this program's experts
    group_ok = group < num_experts
    if USE_PDL:
        # The router's weight is read-only: this program's rows stream into L2 while the kernel before
        # (the norm that makes ``hidden``) still runs. Nothing else is read, nothing written, before the wait.
        if PDL_ROW_BYTES > 0:
            _prefetch_l2(router_ptr + tl.where(group_ok, group, 0).to(tl.int64) * stride_re, PDL_ROW_BYTES)
        gdc_wait()
        gdc_launch_dependents()
    offs_h = tl.arange(0, BLOCK_H)
    # A handful of tokens: fp32 FMAs over a [T_PAD, BLOCK_EG, BLOCK_H] broadcast, no tensor cores (an MMA
    # tile would be mostly padding); the program's time is its BLOCK_EG router rows' read.
    acc = tl.zeros((T_PAD, BLOCK_EG), dtype=tl.float32)
    for h0 in range(0, hidden_size, BLOCK_H):
        cols = h0 + offs_h  # [BLOCK_H]
        col_ok = cols < hidden_size
        x = tl.load(
            hidden_ptr + rows[:, None] * stride_ht + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)  # [T_PAD, BLOCK_H]
        w = tl.load(
            router_ptr + group[:, None] * stride_re + cols[None, :], mask=group_ok[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)  # [BLOCK_EG, BLOCK_H]
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)  # [T_PAD, BLOCK_EG]
    # Rounded to the logits' dtype (the model's) as F.linear's output is: the choice is made from the
    # same values as the reference's (up to the fp32 sum's order).
    tl.store(
        logits_ptr + rows[:, None] * stride_lt + group[None, :],
        acc.to(logits_ptr.dtype.element_ty),
        mask=row_ok[:, None] & group_ok[None, :],
    )
    # The last program to arrive makes the choice from every program's logits (moe_mma_triton's split-K
    # pattern): the barrier orders every thread's stores before the counter's gpu-scope release; the last
    # program's acquire (same atomic) then sees them all, and its .cg loads read them from L2, never a
    # stale L1 line.
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        # Reset for the next launch (the next MoE layer's, a graph replay): every program has arrived.
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        experts = tl.arange(0, BLOCK_E)
        logits = tl.load(
            logits_ptr + rows[:, None] * stride_lt + experts[None, :],
            mask=row_ok[:, None] & (experts < num_experts)[None, :],
            other=0.0,
            cache_modifier=".cg",
        ).to(tl.float32)  # [T_PAD, BLOCK_E]; padded rows read zeros, as router_topk_blocks_kernel
        _topk_blocks_store(
            logits, weights_ptr, ids_ptr, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
            num_tokens, num_experts, expert_start, num_local, TOP_K, K_PAD, T_PAD, BLOCK_E, BLOCK_M, RENORMALIZE,
            PACKED_TOPK,
        )  # fmt: skip


def router_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, k], int32 [T, k]
    """``moe_reference.select_experts`` in one launch (same contract; weights within float32
    rounding of the reference's, ids equal unless two probabilities tie)."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: must be between 1 and the {num_experts} experts")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)  # [T, k]
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)  # [T, k]
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    router_topk_kernel[(num_tokens,)](
        logits, weights, ids, num_experts, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block_e, RENORMALIZE=renormalize,
        num_warps=1 if block_e <= 128 else 4,
    )  # fmt: skip
    return weights, ids


def _blocks_outputs(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    block_m: int,
    expert_start: int,
    num_local_experts: int | None,
    device: torch.device,
) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The checks and outputs the two block-layout launchers share: ``(num_local, (weights, ids,
    sorted_ids, expert_ids, num_padded))``, uninitialized but for ``num_padded`` at zero tokens (no launch
    then writes it). ValueError for a ``top_k`` or an expert share the layer cannot have."""
    num_local = num_experts if num_local_experts is None else num_local_experts
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: must be between 1 and the {num_experts} experts")
    if not (0 <= expert_start and 1 <= num_local and expert_start + num_local <= num_experts):
        raise ValueError(f"experts [{expert_start}, +{num_local}): not a part of the {num_experts} experts")
    num_pairs = num_tokens * top_k
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)  # [T, k]
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)  # [T, k]
    sorted_ids = torch.empty((num_pairs * block_m,), dtype=torch.int32, device=device)  # [T*k*block_m]
    expert_ids = torch.empty((num_pairs,), dtype=torch.int32, device=device)  # [T*k]
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)  # [1]
    if num_tokens == 0:
        num_padded.zero_()
    return num_local, (weights, ids, sorted_ids, expert_ids, num_padded)


def router_topk_blocks(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
    block_m: int,
    expert_start: int = 0,
    num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``router_topk`` plus the grouped GEMM's block layout, in one launch (one program: meant for a
    handful of tokens, see the module docstring). Returns float32 weights ``[T, k]``, int32 ids
    ``[T, k]`` as ``moe_reference.local_expert_ids(ids, expert_start, num_local_experts)`` gives them
    (unchanged when the rank holds every expert, the default), and
    ``moe_reference.direct_block_layout(ids, num_local_experts, block_m, skip_foreign=True)``'s
    ``sorted_ids`` int32 ``[T*k*block_m]``, ``expert_ids`` int32 ``[T*k]``, ``num_padded`` int32 ``[1]``."""
    num_tokens, num_experts = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    num_local, outputs = _blocks_outputs(
        num_tokens, num_experts, top_k, block_m, expert_start, num_local_experts, logits.device
    )
    weights, ids, sorted_ids, expert_ids, num_padded = outputs
    if num_tokens == 0:
        return outputs
    t_pad, block_e = triton.next_power_of_2(num_tokens), triton.next_power_of_2(num_experts)
    router_topk_blocks_kernel[(1,)](
        logits, weights, ids, sorted_ids, expert_ids, num_padded,
        num_tokens, num_experts, logits.stride(0), expert_start, num_local,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), T_PAD=t_pad, BLOCK_E=block_e, BLOCK_M=block_m,
        RENORMALIZE=renormalize,
        num_warps=1 if t_pad * block_e <= 512 else 4,  # untuned: one warp for decode's [1..4, 128] tiles
    )  # fmt: skip
    return weights, ids, sorted_ids, expert_ids, num_padded


# ``router_gemm_topk_blocks``' arrival counter, one int32 per device, shared by every MoE layer: their
# launches run one after another in the stream and each leaves it zero (moe_mma_triton.split_counters'
# pattern, through the same ``quant_kernels.device.arrival_counters``). Allocated once, zeroed, never
# freed: a CUDA graph captured earlier keeps its address (the engine warms up before it captures, so
# the allocation happens outside capture).
ARRIVAL_COUNTER_OWNER = "moe_router_gemm"

# Programs the router's weight read is spread over: Qwen3-30B-A3B's 128 x 2048 fp16 router (512 KB)
# read in 16 KB slices of 4 rows by 32 programs. Fewer programs (16 x 32 KB) lengthen each one's read,
# which the last program waits for before its top-k; more add arrivals on the one counter and programs
# whose only work is a few rows. Untuned: not swept on the device.
ROUTER_GEMM_PROGRAMS = 32
# Elements of one program's [T_PAD, BLOCK_EG, BLOCK_H] product per step: 64 fp32 a thread at 4 warps.
# At one token that is the whole 2048-column row slice in one step (its loads all in flight at once).
ROUTER_GEMM_TILE = 8192


def arrival_counter(device: torch.device) -> torch.Tensor:
    """int32 ``[1]`` arrival counter on ``device`` for ``router_gemm_topk_blocks_kernel``, zero between
    launches: allocated (zeroed) once, then every launch's last program resets it, so no memset launch."""
    return kdevice.arrival_counters(device, 1, ARRIVAL_COUNTER_OWNER)  # [1]: never grown past one


def router_gemm_blocks_config(num_tokens: int, num_experts: int, hidden_size: int) -> tuple[int, int]:
    """``(BLOCK_EG, BLOCK_H)`` of ``router_gemm_topk_blocks``: about ``ROUTER_GEMM_PROGRAMS`` programs of
    ``BLOCK_EG`` router rows (a power of two), and hidden columns per step within ``ROUTER_GEMM_TILE``."""
    block_eg = triton.next_power_of_2(triton.cdiv(num_experts, ROUTER_GEMM_PROGRAMS))
    t_pad = triton.next_power_of_2(num_tokens)
    block_h = min(triton.next_power_of_2(hidden_size), max(32, ROUTER_GEMM_TILE // (t_pad * block_eg)))
    return block_eg, block_h


def router_gemm_topk_blocks(
    hidden: torch.Tensor,  # [T, H] fp16 / bf16 / fp32
    router_weight: torch.Tensor,  # [E, H], hidden's dtype
    top_k: int,
    renormalize: bool,
    block_m: int,
    expert_start: int = 0,
    num_local_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``router_topk_blocks(F.linear(hidden, router_weight), ...)`` in one launch (see the module
    docstring): the same five outputs (float32 weights ``[T, k]``, int32 local ids ``[T, k]``,
    ``sorted_ids`` int32 ``[T*k*block_m]``, ``expert_ids`` int32 ``[T*k]``, ``num_padded`` int32
    ``[1]``), then the router logits ``[T, E]`` in hidden's dtype it chose from (F.linear's up to the
    fp32 sum's order). Meant for a handful of tokens (``QSERVE_MOE_DIRECT_BLOCKS``): every program
    holds all T rows, and the last one all ``[T, E]`` logits."""
    if hidden.dim() != 2 or router_weight.dim() != 2 or hidden.shape[1] != router_weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and router {tuple(router_weight.shape)}: expected [T, H] and [E, H]"
        )
    if hidden.dtype != router_weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype}, the router {router_weight.dtype}: F.linear needs one dtype")
    num_tokens, hidden_size = hidden.shape
    num_experts = router_weight.shape[0]
    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    w = router_weight if router_weight.stride(-1) == 1 else router_weight.contiguous()
    device = x.device
    num_local, outputs = _blocks_outputs(
        num_tokens, num_experts, top_k, block_m, expert_start, num_local_experts, device
    )
    weights, ids, sorted_ids, expert_ids, num_padded = outputs
    logits = torch.empty((num_tokens, num_experts), dtype=x.dtype, device=device)  # [T, E]
    if num_tokens == 0:
        return *outputs, logits
    block_eg, block_h = router_gemm_blocks_config(num_tokens, num_experts, hidden_size)
    router_gemm_topk_blocks_kernel[(triton.cdiv(num_experts, block_eg),)](
        x, w, logits, arrival_counter(device), weights, ids, sorted_ids, expert_ids, num_padded,
        num_tokens, num_experts, hidden_size, x.stride(0), w.stride(0), logits.stride(0), expert_start, num_local,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), T_PAD=triton.next_power_of_2(num_tokens),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_EG=block_eg, BLOCK_H=block_h, BLOCK_M=block_m,
        RENORMALIZE=renormalize,
        num_warps=4,  # untuned: the weight read wants many loads in flight; the last program's top-k crosses 4 warps
        **_pdl_options(w),
        **({"PACKED_TOPK": True} if packed_topk_requested() else {}),
    )  # fmt: skip
    return weights, ids, sorted_ids, expert_ids, num_padded, logits


PACKED_TOPK_ENV = "QSERVE_MOE_PACKED_TOPK"


def packed_topk_requested() -> bool:
    """``QSERVE_MOE_PACKED_TOPK``: "1" gives ``router_gemm_topk_blocks``' last program the packed-key
    top-k (``_topk_blocks_store``'s ``PACKED``: the same picks with half the reductions); unset, empty or
    "1": on (the default since the H100 smoke and MoE run at 8c424b0: batch 1 383.7 -> 387.4 tok/s with
    PDL and the fused cast, bench/RESULTS.md); "0": the max-then-min rounds. Anything else is refused."""
    value = os.environ.get(PACKED_TOPK_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{PACKED_TOPK_ENV}={value!r}: expected 0 or 1")
    return value != "0"


def _pdl_options(router_weight: torch.Tensor) -> dict[str, object]:
    """``quant_kernels.pdl``'s launch options, with the L2 prefetch of the router rows when every row
    starts 16-byte aligned and is a whole number of 16-byte lines (the bulk prefetch's rule)."""
    options: dict[str, object] = launch_options(router_weight.device)
    row_bytes = router_weight.shape[1] * router_weight.element_size()
    aligned = router_weight.data_ptr() % 16 == 0 and (router_weight.stride(0) * router_weight.element_size()) % 16 == 0
    if options and aligned and row_bytes % 16 == 0:
        options["PDL_ROW_BYTES"] = row_bytes
    return options
