"""Triton fused MoE W4A16: the token sort by expert and a grouped dequant-GEMM over the experts a
step hits.

Knows: the stacked canonical expert layout (``quant_kernels.moe_layout``: int32 ``[E, K/8, N]``
words packed along K, scales ``[E, ng, N]``, optional uint8 zeros), the contract of the token sort
(``moe_reference.moe_align_block_size``, the oracle) and how to tile it. Must not know: models,
checkpoint formats, engines. Imported lazily (CUDA, or the CPU tests under TRITON_INTERPRET=1).

``moe_align_block_size_kernel`` (launcher ``moe_align_block_size``): the reference's sort — about
20 torch ops, so 20 launches per MoE layer — in one launch of one program, looping over chunks of
``ALIGN_CHUNK`` pairs: a histogram per group, the padded layout by cumsum, each block's expert, the
sentinel padding, then each pair at its group's cursor plus its rank in the chunk (from a sort of
the chunk by group and lane); past ``QSERVE_MOE_ALIGN_MAX_PAIRS`` pairs (default 16384) the launcher
runs the torch ops instead. Pair order within a group is kept, so its three outputs equal the
reference's element for element (the GEMM would not need that: each row of a block is computed on
its own). Outputs are sized from the shapes: no host sync, CUDA-graph safe.

``moe_w4a16_kernel``: program ``(m, n)`` owns ``BLOCK_M`` rows of the expert-sorted (token,
slot) pairs, all of one expert (``expert_ids[m]``), and ``BLOCK_N`` output columns. Per K-tile
it loads that expert's ``[BLOCK_K / 8, BLOCK_N]`` int32 words once, unpacks their codes,
dequantizes with the tile's one group of scales (``BLOCK_K`` divides the group size) and
multiplies the gathered activation rows. Two uses, one kernel:

* gate_up (``SILU_MUL``): a second accumulator over the up columns ``[I + n]`` of the same
  expert; the epilogue writes ``silu(gate) * up`` as the pair's intermediate row ``[T*k, I]``
  (activation row = pair // top_k);
* down (``MUL_WEIGHT``): activation row = the pair's intermediate row; the epilogue multiplies
  the pair's routing weight and writes row ``[T*k, H]``; the k rows of a token are summed after.

Blocks past ``num_padded`` return at once, padding rows (sentinel ``T*k``) are masked: the grid
depends on shapes only, so launches are CUDA-graph safe with no host sync.

``grouped_moe`` (this kernel's layer and the MMA-operand one's) takes an optional
``moe_reference.BlockLayout`` made before it (the router's one-pair-per-block layout,
``QSERVE_MOE_DIRECT_BLOCKS`` in ``quant_kernels.moe_ops``) and then launches no sort.

Not tuned yet (the default on CUDA; ``QSERVE_FUSED_MOE=0`` opts out, see ``quant_kernels.moe_ops``):
codes are dequantized to the activation dtype per element (no lop3 / MMA-operand layout), one config
per M bucket. Act-order (a per-expert permutation) is not served here; such layers take the
reference-style path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quant_kernels import device as kdevice
from quant_kernels import moe_reference
from quant_kernels.moe_layout import StackedQuantWeight

# Under TRITON_INTERPRET=1 (CPU tests) the dots run in float32 (the interpreter's bf16 dot is wrong).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Pairs per step of the token sort's loops: Qwen3-30B-A3B's decode (8 pairs) and mid-size batches
# sort in one step; a 2048-token prefill chunk (16384 pairs) in 16.
ALIGN_CHUNK = 1024
# QSERVE_MOE_ALIGN_MAX_PAIRS=N: past N (token, slot) pairs the sort runs the reference's torch ops. One
# program walks every pair: on the H200 it lost to them at 4,096 tokens x top-8 (289.5 vs 137.1 µs) and
# won at 512 x 8 (42.5 vs 97.5); on the H100 it won at 1,024 x 8 (76.1 vs 144.4) and tied at 2,048 x 8
# (146.1 vs 149.1; bench/moe.py, 2026-12-05): N = 16384 by default.
ALIGN_MAX_PAIRS_ENV = "QSERVE_MOE_ALIGN_MAX_PAIRS"
ALIGN_MAX_PAIRS_DEFAULT = 16384


def align_max_pairs() -> int:
    """``QSERVE_MOE_ALIGN_MAX_PAIRS`` as a pair count (unset or empty: ``ALIGN_MAX_PAIRS_DEFAULT``);
    anything but a positive integer is refused, naming the variable."""
    value = os.environ.get(ALIGN_MAX_PAIRS_ENV, "")
    if not value:
        return ALIGN_MAX_PAIRS_DEFAULT
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{ALIGN_MAX_PAIRS_ENV}={value!r}: a positive number of (token, slot) pairs, e.g. 16384")
    return int(value)


@triton.jit
def _dequant_tile(
    qw_ptr, s_ptr, z_ptr, expert, k0, offs_n, n_mask,
    stride_qe, stride_qk, stride_se, stride_sg, stride_ze, stride_zg,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, dtype: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The expert's ``[BLOCK_K, BLOCK_N]`` weight tile at rows ``k0 + [0, BLOCK_K)`` as ``dtype``:
    each int32 word is loaded once and its 8 codes unpacked along a new axis (packed row
    ``8 * w + j`` is slot ``j`` of word row ``w``), then reshaped into the tile's rows."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(
        qw_ptr + expert * stride_qe + offs_w[:, None] * stride_qk + offs_n[None, :],
        mask=n_mask[None, :],
        other=0,
    )  # int32 [BK/8, BN]
    shifts = tl.arange(0, 8) * 4  # [8]
    codes = (words[:, None, :] >> shifts[None, :, None]) & 0xF  # [BK/8, 8, BN]
    codes = tl.reshape(codes, (BLOCK_K, offs_n.shape[0]))  # [BK, BN]
    group = k0 // GROUP_SIZE
    scales = tl.load(s_ptr + expert * stride_se + group * stride_sg + offs_n, mask=n_mask, other=0.0)  # [BN]
    if HAS_ZEROS:
        zeros = tl.load(z_ptr + expert * stride_ze + group * stride_zg + offs_n, mask=n_mask, other=0).to(tl.int32)
    else:
        zeros = tl.full((offs_n.shape[0],), 8, tl.int32)
    return ((codes - zeros[None, :]).to(tl.float32) * scales.to(tl.float32)[None, :]).to(dtype)


@triton.jit
def moe_w4a16_kernel(
    a_ptr,  # [rows of A, K]: x [T, H] (gate_up) or the intermediate [T*k, I] (down)
    qw_ptr,  # int32 [E, K/8, N_total]
    s_ptr,  # [E, ng, N_total]
    z_ptr,  # uint8 [E, ng, N_total] (a placeholder when not HAS_ZEROS)
    c_ptr,  # [T*k, N]
    topk_w_ptr,  # float32 [T*k]
    sorted_ids_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [max_padded / BLOCK_M]
    num_padded_ptr,  # int32 [1]
    N, K, num_pairs, up_offset,
    stride_am, stride_qe, stride_qk, stride_se, stride_sg, stride_ze, stride_zg, stride_cm,
    A_ROW_DIV: tl.constexpr,  # top_k for gate_up (A row = pair // top_k), 1 for down
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dtype = c_ptr.dtype.element_ty
    compute = tl.float32 if DOT_F32 else dtype
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None], other=0.0)
        a = a.to(compute)
        w = _dequant_tile(
            qw_ptr, s_ptr, z_ptr, expert, k0, offs_n, n_mask,
            stride_qe, stride_qk, stride_se, stride_sg, stride_ze, stride_zg, GROUP_SIZE, HAS_ZEROS, compute, BLOCK_K,
        )  # fmt: skip
        acc += tl.dot(a, w)
        if SILU_MUL:
            w_up = _dequant_tile(
                qw_ptr, s_ptr, z_ptr, expert, k0, offs_n + up_offset, n_mask,
                stride_qe, stride_qk, stride_se, stride_sg, stride_ze, stride_zg, GROUP_SIZE, HAS_ZEROS, compute, BLOCK_K,
            )  # fmt: skip
            acc_up += tl.dot(a, w_up)
    if SILU_MUL:
        # Rounded to the activation dtype first, as the unfused gate_up output would be.
        gate = acc.to(dtype).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(dtype).to(tl.float32)
    if MUL_WEIGHT:
        weight = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0)  # [BM]
        acc = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(
        c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :],
        acc.to(dtype),
        mask=valid[:, None] & n_mask[None, :],
    )


@triton.jit
def moe_align_block_size_kernel(
    topk_ids_ptr,  # int [T*k] (int32 from select_experts / local_expert_ids)
    sorted_ids_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [max_padded / BLOCK_M]
    num_padded_ptr,  # int32 [1]
    num_pairs, num_experts, max_padded,
    BLOCK_M: tl.constexpr,
    NUM_BINS: tl.constexpr,  # a power of two >= the groups (experts, plus the sentinel's with skip_foreign)
    CHUNK: tl.constexpr,  # pairs per loop step (a power of two)
    BLOCKS_CHUNK: tl.constexpr,  # blocks per step of the expert_ids loop
):  # fmt: skip
    """``moe_reference.moe_align_block_size`` in one program: count the pairs of each group, lay the
    padded groups out (a cumsum), write each block's expert, fill ``sorted_ids`` with the sentinel,
    then place every pair. A pair's place is its group's cursor (pairs of that group in earlier
    chunks) plus its rank among its group's pairs in this chunk, read off a sort of the chunk by
    (group, lane): so each group keeps pair order and the result equals the reference exactly."""
    bins = tl.arange(0, NUM_BINS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((NUM_BINS,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        valid = start + lanes < num_pairs
        ids = tl.load(topk_ids_ptr + start + lanes, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(ids, NUM_BINS, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [NUM_BINS]
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    is_expert = bins < num_experts  # the sentinel's group (bin num_experts) lies past num_padded
    tl.store(num_padded_ptr, tl.sum(tl.where(is_expert, padded, 0), 0))
    # A block's expert: how many experts end at or before its first row (the reference's
    # searchsorted), at most the last expert (blocks past num_padded are never computed).
    expert_ends = tl.where(is_expert, ends, max_padded)  # no block starts at max_padded
    num_blocks = max_padded // BLOCK_M
    for b0 in range(0, num_blocks, BLOCKS_CHUNK):
        blocks = b0 + tl.arange(0, BLOCKS_CHUNK)
        ended = (expert_ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32)  # [BLOCKS_CHUNK, NUM_BINS]
        expert = tl.minimum(tl.sum(ended, 1), num_experts - 1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < num_blocks)
    for r0 in range(0, max_padded, CHUNK):
        rows = r0 + lanes
        tl.store(sorted_ids_ptr + rows, tl.full((CHUNK,), 0, tl.int32) + num_pairs, mask=rows < max_padded)
    tl.debug_barrier()  # the padding lands before the pairs that overwrite some of it
    cursor = starts  # [NUM_BINS]: where each group's next pair goes
    for start in range(0, num_pairs, CHUNK):
        valid = start + lanes < num_pairs
        ids = tl.load(topk_ids_ptr + start + lanes, mask=valid, other=0).to(tl.int32)
        keys = tl.sort(tl.where(valid, ids, NUM_BINS) * CHUNK + lanes)  # by group, then lane; dead lanes last
        group = keys // CHUNK
        pair = start + keys % CHUNK
        in_chunk = tl.histogram(ids, NUM_BINS, mask=valid)
        # sorted lane p of group g holds g's (p - first lane of g) pair of this chunk
        base = cursor - (tl.cumsum(in_chunk, 0) - in_chunk)  # [NUM_BINS]
        row = tl.gather(base, tl.minimum(group, NUM_BINS - 1), 0) + lanes
        tl.store(sorted_ids_ptr + row, pair, mask=group < NUM_BINS)
        cursor += in_chunk


def moe_align_block_size(
    topk_ids: torch.Tensor,  # int [T, k]
    num_experts: int,
    block_m: int,
    skip_foreign: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_reference.moe_align_block_size`` (same signature, same result, bit for bit) in one
    single-program launch instead of ~20 torch ops: outputs sized from the shapes, no host sync. Past
    ``align_max_pairs()`` pairs (long prefills) the torch ops themselves, faster there."""
    num_pairs = topk_ids.numel()
    if num_pairs > align_max_pairs():
        return moe_reference.moe_align_block_size(topk_ids, num_experts, block_m, skip_foreign)
    num_groups = num_experts + 1 if skip_foreign else num_experts
    max_padded = moe_reference.max_padded_rows(num_pairs, num_groups, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty((max_padded,), dtype=torch.int32, device=device)  # [max_padded]
    expert_ids = torch.empty((max_padded // block_m,), dtype=torch.int32, device=device)  # [num_blocks]
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)  # [1]
    num_bins = triton.next_power_of_2(num_groups)
    moe_align_block_size_kernel[(1,)](
        topk_ids.reshape(-1).contiguous(), sorted_ids, expert_ids, num_padded,
        num_pairs, num_experts, max_padded,
        BLOCK_M=block_m, NUM_BINS=num_bins, CHUNK=min(max(triton.next_power_of_2(num_pairs), 16), ALIGN_CHUNK),
        BLOCKS_CHUNK=min(128, max(16, 8192 // num_bins)),  # a [BLOCKS_CHUNK, NUM_BINS] compare per step
        num_warps=4,
    )  # fmt: skip
    return sorted_ids, expert_ids, num_padded


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoEConfig:
    """Untuned rules: small blocks of rows while few pairs land on each expert (decode), larger
    ones for prefill. (Measured tables per architecture are the next step: bench/moe.py.)"""
    pairs_per_expert = num_tokens * top_k / max(num_experts, 1)
    if pairs_per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    return MoEConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


def _block_k(group_size: int, in_features: int) -> int:
    """A K-tile inside one group: divides the group size and K."""
    block = 64
    while block > 16 and (group_size % block or in_features % block):
        block //= 2
    if group_size % block or in_features % block:
        raise ValueError(f"fused MoE: group size {group_size} / K={in_features} need a multiple of 16")
    return block


def supports(weight: StackedQuantWeight) -> bool:
    """Whether the kernel serves this stacked weight (4-bit, no act-order, tiles inside groups)."""
    return (
        weight.bits == 4
        and weight.perm is None
        and weight.group_size % 16 == 0
        and weight.in_features % 16 == 0
        and weight.scales.dtype in (torch.float16, torch.bfloat16, torch.float32)
    )


def _launch(
    a: torch.Tensor,
    weight: StackedQuantWeight,
    out: torch.Tensor,
    n: int,
    up_offset: int,
    topk_weights: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    silu_mul: bool,
    mul_weight: bool,
    config: MoEConfig,
) -> None:
    zeros = weight.zeros if weight.zeros is not None else kdevice.placeholder(a.device, torch.uint8)
    stride_ze, stride_zg = (weight.zeros.stride(0), weight.zeros.stride(1)) if weight.zeros is not None else (0, 0)
    k = weight.in_features
    grid = (sorted_ids.shape[0] // config.block_m, triton.cdiv(n, config.block_n))
    moe_w4a16_kernel[grid](
        a, weight.qweight, weight.scales, zeros, out, topk_weights, sorted_ids, expert_ids, num_padded,
        n, k, num_pairs, up_offset,
        a.stride(0), weight.qweight.stride(0), weight.qweight.stride(1), weight.scales.stride(0),
        weight.scales.stride(1), stride_ze, stride_zg, out.stride(0),
        A_ROW_DIV=a_row_div, GROUP_SIZE=min(weight.group_size, k), HAS_ZEROS=weight.zeros is not None,
        SILU_MUL=silu_mul, MUL_WEIGHT=mul_weight, DOT_F32=_INTERPRET,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=_block_k(min(weight.group_size, k), k),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def fused_moe_w4a16(
    x: torch.Tensor,  # [T, H]
    w_gate_up: StackedQuantWeight,  # E experts of K=H, N=2I (gate | up)
    w_down: StackedQuantWeight,  # E experts of K=I, N=H
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
    config: MoEConfig | None = None,
    skip_foreign: bool = False,
    layout: moe_reference.BlockLayout | None = None,
) -> torch.Tensor:  # [T, H]
    """Same signature and result as ``moe_reference.fused_moe_w4a16``; three launches (the token
    sort, gate_up, down) plus the k-way sum, with no host sync. ``skip_foreign`` (expert
    parallelism): ids equal to ``num_experts`` (another rank's experts) are sorted past the
    computed blocks and their output rows stay zero. ``layout``: the pairs' blocks made already
    (``grouped_moe``): no sort launch."""
    num_tokens, top_k = topk_ids.shape
    config = config or default_config(num_tokens, top_k, w_gate_up.num_experts)

    def launch(a, out, gate_up, weights, sorted_ids, expert_ids, num_padded, num_pairs, a_row_div):  # noqa: ANN001, ANN202
        weight, n = (w_gate_up, w_down.in_features) if gate_up else (w_down, x.shape[1])
        _launch(a, weight, out, n, n if gate_up else 0, weights, sorted_ids, expert_ids, num_padded, num_pairs,
                a_row_div, gate_up, not gate_up, config)  # fmt: skip

    return grouped_moe(
        x, topk_weights, topk_ids, w_gate_up.num_experts, w_down.in_features, config.block_m, skip_foreign, launch,
        layout,
    )  # fmt: skip


def block_layout(
    topk_ids: torch.Tensor,  # int [T, k]
    num_experts: int,
    block_m: int,
    skip_foreign: bool,
    layout: moe_reference.BlockLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The grouped GEMMs' ``sorted_ids`` / ``expert_ids`` / ``num_padded``: ``layout``'s when the
    caller has them (no launch), else the one-launch sort. A layout for another ``block_m`` is refused:
    its blocks would be read with the wrong stride (a host-side int check, no sync)."""
    if layout is None:
        return moe_align_block_size(topk_ids, num_experts, block_m, skip_foreign)
    if layout.block_m != block_m or layout.expert_ids.shape[0] * block_m != layout.sorted_ids.shape[0]:
        raise ValueError(f"a block layout of block_m={layout.block_m} for a grouped GEMM of block_m={block_m}")
    return layout.sorted_ids, layout.expert_ids, layout.num_padded


def grouped_moe(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
    num_experts: int,
    inter: int,  # the experts' intermediate width I
    block_m: int,
    skip_foreign: bool,
    launch,  # noqa: ANN001 - (a, out, gate_up, weights, sorted_ids, expert_ids, num_padded, num_pairs, a_row_div)
    layout: moe_reference.BlockLayout | None = None,
) -> torch.Tensor:  # [T, H]
    """What every fused MoE kernel's layer does around its two launches (this module's and the
    MMA-operand one, ``moe_mma_triton``): the one-launch token sort (or ``layout``, blocks made
    already: ``block_layout``), the gate_up launch writing ``silu(gate) * up`` per pair ``[T*k, I]``
    (activation row = pair // k), the down launch writing each pair's weighted row ``[T*k, H]``, and
    the k-way sum. ``launch(gate_up=True)`` / ``(gate_up=False)`` runs one of the two with the
    sort's outputs."""
    num_tokens, top_k = topk_ids.shape
    hidden = x.shape[1]
    sorted_ids, expert_ids, num_padded = block_layout(topk_ids, num_experts, block_m, skip_foreign, layout)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    x = x.contiguous()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [T*k, I]
    launch(x, act, True, weights, sorted_ids, expert_ids, num_padded, num_pairs, top_k)
    alloc = torch.zeros if skip_foreign else torch.empty  # a skipped pair's row is never written
    out = alloc((num_pairs, hidden), dtype=x.dtype, device=x.device)  # [T*k, H]
    launch(act, out, False, weights, sorted_ids, expert_ids, num_padded, num_pairs, 1)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
