"""Triton fused MoE W4A16 on expert weights pre-shuffled to the MMA A-operand order (swap-AB).

Knows: the stacked canonical expert layout (``quant_kernels.moe_layout``), how it becomes one
stacked tensor of per-expert MMA-operand weights (``StackedMmaWeight``: each expert shuffled by
``w4a16_mma_triton.prepare``, i.e. ``repack.mma_shuffle`` for the device's k-width), the token
sort contract of ``moe_reference.moe_align_block_size`` (``sorted_ids`` / ``expert_ids`` /
``num_padded``) and how to tile them. Must not know: models, checkpoint formats, engines; how one
output tile's K loop works (that is ``w4a16_mma_triton._accumulate``, imported, not copied).
Imported lazily (CUDA, or the CPU tests under TRITON_INTERPRET=1).

``moe_mma_kernel``: program ``(m, n)`` owns ``BLOCK_M`` rows of the expert-sorted (token, slot)
pairs, all of one expert (``expert_ids[m]``), and one column tile. It offsets the weight, scale
and zero pointers by that expert and hands the gathered activation rows to ``_accumulate`` as its
``offs_m`` (``_accumulate`` addresses x as ``x + offs_m * stride``, masked by ``mask_m``: any row
indices work), so the dequantized weight tile is the MMA's A operand and stays in registers, as
in the dense kernel (lop3 dequant, scales on the fp32 partial when a K-tile lies in one group).

* gate_up (``SILU_MUL``): the ``BLOCK_N`` weight columns of one MMA tile are ``BLOCK_N / 2`` gate
  columns ``n`` and the matching up columns ``I + n`` (storage rows of 16-column blocks, so ``I``
  must be a multiple of ``BLOCK_N / 2``): one K loop, one activation load per K-tile for both. The
  epilogue splits the tile, rounds both halves to the activation dtype (as the unfused gate_up
  output would be) and writes ``silu(gate) * up`` to the pair's intermediate row ``[T*k, I]``
  (activation row = pair // top_k).
* down (``MUL_WEIGHT``): activation row = the pair's intermediate row; the epilogue rounds,
  multiplies the pair's routing weight and writes row ``[T*k, H]``; the k rows of a token are
  summed after.

Blocks past ``num_padded`` return at once and padding pairs (sentinel ``T*k``) are masked, so the
grid depends on shapes only: CUDA-graph safe, no host sync.

Split-K (``MoEMmaConfig.split_k`` > 1; at decode by default, ``QSERVE_MOE_SPLIT_K`` below):
a kernel of its own, ``moe_mma_split_kernel``, so that the default launch above stays the GPU-tested
one (its signature, 2-D grid and PTX are unchanged since 890e2ef); the two share the tile set-up,
the K loop and the SiLU epilogue through ``@triton.jit`` helpers, which Triton inlines. A third grid
axis; program ``z`` sums K-tiles ``[z*per, (z+1)*per)``, ``per = cdiv(K-tiles, split_k)`` (a range
may be empty). A decode step of Qwen3-30B-A3B launches only ~8 pair blocks x 24 (gate_up)
/ 32 (down) column tiles, each walking all of K: about 4x the weight-bytes floor on the H100.

* down: each program multiplies its fp32 partial by the pair's routing weight and atomically adds
  it to row ``pair // top_k`` of an fp32 ``[T, H]`` accumulator (the k-way sum, fused); the layer's
  result is that accumulator cast to the activation dtype (``.to``, in place of the torch sum). The
  gate_up launch zeroes the accumulator (every program a grid-stride share, before its early
  return): no memset launch, stream-ordered before the down launch, repeated by graph replays.
  Foreign pairs (``skip_foreign``) are never computed, so they add nothing. No per-pair rounding of
  the down product (the non-split path rounds each pair's row): one rounding at the cast.
* gate_up: the SiLU needs the whole K sum. Each program stores its fp32 partial into its slot of a
  per-call workspace ``[split_k, T*k, 2I]``; a per-tile arrival counter (int32, ``split_counters``:
  zeroed once per device, reset by each tile's last program, so the next launch and graph replays
  find it zero) elects the last program, which sums the slots (``.cg`` loads after the counter's
  acquire) and runs the usual epilogue. One launch; same launch count per layer as without split.

``QSERVE_MOE_FUSED_CAST`` (``fused_cast_requested``; on by default, ``=0`` turns it off): the
down launch also writes the layer's output in the activation dtype, so no torch cast follows it (one
launch fewer a layer: 48 graph nodes of ~1 µs each and their gaps in a Qwen3-30B-A3B decode step, the
H200 profile of 2026-12-07). Every program of a column tile (all pair blocks and K shares, idle blocks
included) arrives on that tile's counter (``split_counters``, which gate_up left zero) after its atomic
adds; the last reads the tile's fp32 sums for all T rows (``.cg``) and stores them rounded, the same
rounding the torch cast made, then resets the counter.

PDL (``QSERVE_ENABLE_PDL=1``, ``quant_kernels.pdl``): both split-K launches wait for the kernel before
them and then let the next one start. gate_up's experts come from the router right before it, so it
reads nothing before the wait; down's blocks were written by that router, which is complete once every
gate_up program has passed its own wait (the only way down can start), so down reads its block's
expert id (``.cg``) and prefetches its first ``num_stages`` K-tiles into L2 before waiting, as the
dense kernel does.

``QSERVE_MOE_SPLIT_K`` (``split_k_setting``, read where ``default_config`` is chosen): unset,
empty or "auto" (the default): ``default_config`` picks a split while an expert gets <= 2 pairs
(decode); "0" or "1": off, exactly the launches without split-K; N >= 2: that split; anything
else: ValueError.

The default MoE kernel on CUDA (``QSERVE_MOE_KERNEL=fused`` leaves it; read in ``quant_kernels.moe_ops``):
it won every row of bench/moe.py on the H200 and the H100.
Untuned: one starting config per M bucket (``default_config``), the automatic split measured at
batch 1 only (1.02x on the H100), no stream-K; PDL only in the split-K launches (below). 4-bit, no
act-order; other layers keep the other paths.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quant_kernels import device as kdevice
from quant_kernels import moe_reference
from quant_kernels import w4a16_mma_triton as mma
from quant_kernels.moe_layout import StackedQuantWeight
from quant_kernels.moe_triton import block_layout, grouped_moe  # the sort or given blocks, buffers, the sum
from quant_kernels.pdl import launch_options
from quant_kernels.repack import MMA_PAD_N, MmaQuantWeight, mma_kwidth, mma_zeros
from quant_kernels.w4a16_mma_triton import _accumulate, _block_k_ok, _k_share, _prefetch_k_tiles, groups_per_tile

# Under TRITON_INTERPRET=1 (CPU tests) inline PTX cannot run and bf16 dots are unreliable in the
# interpreter: the launcher passes FAST=False / DOT_F32=True there, as the dense kernel does.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class StackedMmaWeight:
    """One layer's experts in the MMA-operand order, experts along dim 0 (``MmaQuantWeight``
    stacked): each ``qweight[e]`` is ``mma_shuffle`` of expert ``e``'s canonical weight."""

    bits: int
    group_size: int  # effective (per-channel: K)
    in_features: int  # K (logical)
    out_features: int  # N (logical; gate_up: 2I, gate columns then up columns)
    kwidth: int  # the A operand's k-width the layout was built for (repack.mma_kwidth)
    qweight: torch.Tensor  # int32 [E, N_pad / 4, K_pad * 4 / vpw]
    scales: torch.Tensor  # [E, num_groups, N], contiguous
    zeros: torch.Tensor | None = None  # fp16 [E, num_groups, N]: z - 2**(bits-1); None = symmetric

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def n_pad(self) -> int:
        return self.qweight.shape[1] * 4

    def expert(self, index: int) -> MmaQuantWeight:
        """Expert ``index`` as a dense-kernel weight (views; tests and debugging)."""
        return MmaQuantWeight(
            self.bits, self.group_size, self.in_features, self.out_features, self.kwidth, self.qweight[index],
            self.scales[index], None if self.zeros is None else self.zeros[index],
        )  # fmt: skip

    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.zeros]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def supports(gate_up: StackedQuantWeight, down: StackedQuantWeight) -> bool:
    """Whether the kernel serves this layer: 4-bit, no act-order, K-tiles of 64 or 128 inside one
    group or holding whole groups, ``I`` a multiple of 64 (the gate and up halves of a tile are
    whole 16-column blocks of the stored order and no tile crosses from gate into up), and on a
    CUDA device one with 16-bit tensor-core MMA (sm80+)."""
    device = gate_up.qweight.device
    if kdevice.triton_serves(device) and kdevice.capability(device) < (8, 0):
        return False
    inter = down.in_features
    return (
        all(w.bits == 4 and w.perm is None for w in (gate_up, down))
        and gate_up.out_features == 2 * inter
        and inter % MMA_PAD_N == 0
        and all(any(_block_k_ok(bk, w.group_size, w.in_features) for bk in (64, 128)) for w in (gate_up, down))
    )


def prepare_stacked(weight: StackedQuantWeight, kwidth: int | None = None) -> StackedMmaWeight:
    """Load-time: canonical stacked -> MMA-operand order for this device's MMA generation, expert
    by expert (one expert's temporary at a time)."""
    device = weight.qweight.device
    if kwidth is None:
        kwidth = mma_kwidth(kdevice.capability(device)) if kdevice.triton_serves(device) else 2
    qweight = None
    for e in range(weight.num_experts):
        shuffled = mma.prepare(weight.expert(e), kwidth)  # int32 [N_pad / 4, K_pad * 4 / vpw]
        if qweight is None:
            qweight = torch.empty((weight.num_experts, *shuffled.qweight.shape), dtype=torch.int32, device=device)
        qweight[e].copy_(shuffled.qweight)
    zeros = mma_zeros(weight)  # the stacked uint8 zeros as the dense kernel takes them (fp16 z - 8)
    return StackedMmaWeight(
        weight.bits, weight.group_size, weight.in_features, weight.out_features, kwidth, qweight,
        weight.scales.contiguous(), None if zeros is None else zeros.contiguous(),
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def moe_mma_kernel(
    a_ptr,  # [rows of A, K] fp16 / bf16: x [T, H] (gate_up) or the intermediate [T*k, I] (down)
    qw_ptr,  # int32 [E, N_pad / 4, K_pad * 4 / vpw], MMA-operand order per expert
    scales_ptr,  # [E, num_groups, N_total]
    zeros_ptr,  # fp16 [E, num_groups, N_total]: z - 2**(bits-1) (a placeholder when not HAS_ZEROS)
    c_ptr,  # [T*k, N_out]
    topk_w_ptr,  # float32 [T*k]
    sorted_ids_ptr,  # int32 [max_padded]
    expert_ids_ptr,  # int32 [max_padded / BLOCK_M]
    num_padded_ptr,  # int32 [1]
    N_total,  # weight columns (gate_up: 2I)
    N_out,  # output columns (gate_up: I)
    K,
    num_pairs,
    up_offset,  # gate_up: I, the first up column
    group_size: tl.constexpr,
    stride_am,
    stride_qe,
    stride_qr,
    stride_se,
    stride_sg,  # scales, zeros and c have unit N stride (the launcher makes it so)
    stride_ze,
    stride_zg,
    stride_cm,
    A_ROW_DIV: tl.constexpr,  # top_k for gate_up (activation row = pair // top_k), 1 for down
    SILU_MUL: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    NG: tl.constexpr,
    SCALE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # weight columns of the MMA tile (gate_up: half gate, half up)
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """The default launch (grid ``(pair blocks, column tiles)``, all of K per program): signature,
    grid and arguments as at 890e2ef, the GPU-tested launch, and its PTX byte for byte (compared for
    sm90 / sm89 / sm86 when split-K moved to ``moe_mma_split_kernel``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
    pairs, valid, a_rows, expert, offs_out, offs_n, mask_n, rows = _tile_rows_cols(
        sorted_ids_ptr, expert_ids_ptr, pid_m, pid_n, N_total, num_pairs, up_offset, A_ROW_DIV, SILU_MUL,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, _, _ = _expert_tile_sum(
        a_ptr, qw_ptr, scales_ptr, zeros_ptr, expert, a_rows, offs_n, rows, valid, mask_n, 0, 1, K, num_pairs,
        group_size, stride_am, stride_qe, stride_qr, stride_se, stride_sg, stride_ze, stride_zg, BITS, KW,
        HAS_ZEROS, NG, SCALE_W, BLOCK_M, BLOCK_N, BLOCK_K, FAST, DOT_F32, EVEN_K, False,
    )  # fmt: skip
    if SILU_MUL:
        _silu_mul_store(acc, c_ptr, pairs, valid, offs_out, N_out, stride_cm, BLOCK_N, BLOCK_M)
    else:
        dtype = c_ptr.dtype.element_ty
        res = acc
        if MUL_WEIGHT:
            weight = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0)  # [BM]
            res = res.to(dtype).to(tl.float32) * weight[None, :]
        tl.store(
            c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_out[None, :],
            tl.trans(res).to(dtype),
            mask=valid[:, None] & (offs_out < N_out)[None, :],
        )


@triton.jit
def _tile_rows_cols(
    sorted_ids_ptr,
    expert_ids_ptr,
    pid_m,
    pid_n,
    N_total,
    num_pairs,
    up_offset,
    A_ROW_DIV: tl.constexpr,
    SILU_MUL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program ``(pid_m, pid_n)``'s set-up, both kernels: its ``BLOCK_M`` pairs (sentinel ``T*k`` for
    padding) and which are ``valid``, their activation rows ``a_rows``, the block's ``expert``
    (int64), the output columns ``offs_out`` (gate_up: ``[BN / 2]`` intermediate columns; down:
    ``[BN]``), the weight columns ``offs_n`` ``[BN]`` (gate_up: the gate half, then the up half),
    their ``mask_n`` and storage ``rows`` ``[BN / 4]``."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < num_pairs
    a_rows = pairs // A_ROW_DIV  # [BM] gathered activation rows (masked where not valid)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if SILU_MUL:
        HALF: tl.constexpr = BLOCK_N // 2
        offs_out = pid_n * HALF + tl.arange(0, HALF)  # [HALF] intermediate columns
        j = tl.arange(0, BLOCK_N)
        offs_n = tl.where(j < HALF, pid_n * HALF + j, up_offset + pid_n * HALF + j - HALF)  # [BN]
        jr = tl.arange(0, BLOCK_N // 4)
        rows = tl.where(
            jr < HALF // 4, pid_n * (HALF // 4) + jr, (up_offset + pid_n * HALF) // 4 + jr - HALF // 4
        )  # [BN / 4] storage rows: the gate blocks, then the up blocks
    else:
        offs_out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        offs_n = offs_out
        rows = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)  # [BN / 4]
    mask_n = offs_n < N_total
    return pairs, valid, a_rows, expert, offs_out, offs_n, mask_n, rows


@triton.jit
def _expert_tile_sum(
    a_ptr,
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    expert,
    a_rows,
    offs_n,
    rows,
    valid,
    mask_n,
    pid_k,
    split_k,
    K,
    num_pairs,
    group_size: tl.constexpr,
    stride_am,
    stride_qe,
    stride_qr,
    stride_se,
    stride_sg,
    stride_ze,
    stride_zg,
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    NG: tl.constexpr,
    SCALE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """``(acc, kt_start, kt_end)``: the tile's fp32 ``[BN, BM]`` sum over K-tiles ``[kt_start,
    kt_end)`` of ``expert``'s weight (``_accumulate`` with the expert's weight, scale and zero
    pointers): all of K, or with ``SPLIT`` program ``pid_k``'s share of ``split_k`` (``per =
    cdiv(K-tiles, split_k)`` tiles from ``pid_k * per``; a range may be empty: zeros)."""
    expert_qw = qw_ptr + expert * stride_qe
    expert_scales = scales_ptr + expert * stride_se
    expert_zeros = zeros_ptr + expert * stride_ze
    if SPLIT:
        kt_start, kt_end = _k_share(pid_k, split_k, K, BLOCK_K)  # may be an empty range: zeros
    else:
        kt_start = 0
        kt_end = tl.cdiv(K, BLOCK_K)
    acc = _accumulate(
        a_ptr,
        expert_qw,
        expert_scales,
        expert_zeros,
        qw_ptr,  # the permutation: never read (HAS_PERM=False)
        a_rows,
        offs_n,
        rows,
        valid,
        mask_n,
        kt_start,
        kt_end,
        num_pairs,
        K,
        group_size,
        stride_am,
        stride_qr,
        stride_sg,
        stride_zg,
        BITS,
        KW,
        HAS_ZEROS,
        False,
        NG,
        SCALE_W,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        FAST,
        DOT_F32,
        True,
        EVEN_K,
    )  # fp32 [BN, BM]
    return acc, kt_start, kt_end


@triton.jit
def _silu_mul_store(
    acc,  # fp32 [BLOCK_N, BLOCK_M]: the gate columns, then the up columns
    c_ptr,  # [T*k, I]
    pairs,  # [BLOCK_M]
    valid,  # [BLOCK_M]
    offs_out,  # [BLOCK_N / 2] intermediate columns
    N_out,
    stride_cm,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """gate_up's epilogue, both kernels: ``silu(gate) * up`` of a whole-K tile, written to the pairs' rows."""
    HALF: tl.constexpr = BLOCK_N // 2
    dtype = c_ptr.dtype.element_ty
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))  # [HALF, BM] each
    # rounded to the activation dtype first, as the unfused gate_up output would be
    gate = gate.to(dtype).to(tl.float32)
    res = gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)
    tl.store(
        c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_out[None, :],
        tl.trans(res).to(dtype),
        mask=valid[:, None] & (offs_out < N_out)[None, :],
    )


@triton.jit(do_not_specialize=["num_pairs"])
def moe_mma_split_kernel(
    a_ptr,  # as moe_mma_kernel's, up to stride_cm (the launcher passes both kernels those arguments)
    qw_ptr,
    scales_ptr,
    zeros_ptr,
    c_ptr,  # gate_up: [T*k, I]; down: fp32 [T, H], zeroed by the gate_up launch, atomically added
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    N_total,
    N_out,
    K,
    num_pairs,
    up_offset,
    group_size: tl.constexpr,
    stride_am,
    stride_qe,
    stride_qr,
    stride_se,
    stride_sg,
    stride_ze,
    stride_zg,
    stride_cm,
    ws_ptr,  # gate_up: fp32 [split_k, T*k, 2I] partials (down: a never-read placeholder)
    cnt_ptr,  # int32 arrival counters, zero between launches: gate_up [>= tiles]; down with CAST_OUT [>= column tiles]
    zero_ptr,  # ZERO_OUT: the down launch's fp32 [T, H] output, zeroed here (likewise)
    zero_numel,  # ZERO_OUT: elements of zero_ptr
    split_k,  # programs along K per output tile (grid axis 2)
    stride_wsk,
    stride_wsm,
    A_ROW_DIV: tl.constexpr,  # top_k for gate_up, 1 for down
    SILU_MUL: tl.constexpr,  # gate_up; else down (always weighted by the routing weight)
    BITS: tl.constexpr,
    KW: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    NG: tl.constexpr,
    SCALE_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FAST: tl.constexpr,
    DOT_F32: tl.constexpr,
    EVEN_K: tl.constexpr,
    OUT_ROW_DIV: tl.constexpr,  # down: top_k (output row = pair // top_k, the k-way sum)
    ZERO_OUT: tl.constexpr,  # gate_up zeroes the down launch's output first
    ZERO_BLOCK: tl.constexpr = 256,
    # down with QSERVE_MOE_FUSED_CAST: each column tile's last program to arrive (cnt_ptr: one counter a
    # tile) writes the tile's finished fp32 sums to cast_ptr ([T, H], the activation dtype)
    CAST_OUT: tl.constexpr = False,
    cast_ptr=None,
    CAST_ROWS: tl.constexpr = 16,
    USE_PDL: tl.constexpr = False,  # launched with PDL (quant_kernels.pdl): nothing written before the wait
    PDL_TILES: tl.constexpr = 0,  # down: K-tiles of the block's expert weights prefetched into L2 before it
):
    """The split-K launch (grid ``(pair blocks, column tiles, split_k)``): program ``z`` sums
    its share of the K-tiles; gate_up reduces the shares in each tile's last program, down adds them
    into the token rows (the module docstring's "Split-K")."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if USE_PDL:
        if PDL_TILES > 0:
            # The down launch follows gate_up, which waits for the router before its programs let this
            # launch start: the router's blocks are final here (read from L2, .cg: no L1 line of an earlier
            # layer's), and the weights are read-only, so the block's first K-tiles can stream into L2
            # while gate_up finishes. Nothing is written before the wait.
            _prefetch_expert_tiles(
                qw_ptr, expert_ids_ptr, num_padded_ptr, pid_m, pid_n, pid_k, split_k, K, stride_qe, stride_qr,
                BITS, BLOCK_M, BLOCK_N, BLOCK_K, PDL_TILES,
            )  # fmt: skip
        gdc_wait()
        gdc_launch_dependents()
    if ZERO_OUT:
        # Before the early return below: every program of the grid takes a share (grid-stride), so
        # the down launch that follows in the stream finds its accumulator zero without a memset launch.
        num_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        program = pid_m + tl.num_programs(0) * (pid_n + tl.num_programs(1) * pid_k)
        for start in range(program * ZERO_BLOCK, zero_numel, num_programs * ZERO_BLOCK):
            offs_z = start + tl.arange(0, ZERO_BLOCK)  # [ZERO_BLOCK]
            tl.store(zero_ptr + offs_z, tl.zeros((ZERO_BLOCK,), dtype=tl.float32), mask=offs_z < zero_numel)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        if CAST_OUT:  # an idle block still arrives: its tile's last program casts
            _arrive_then_cast(
                cnt_ptr, c_ptr, cast_ptr, pid_n, num_pairs // OUT_ROW_DIV, N_out, stride_cm, BLOCK_N, CAST_ROWS
            )
        return
    pairs, valid, a_rows, expert, offs_out, offs_n, mask_n, rows = _tile_rows_cols(
        sorted_ids_ptr, expert_ids_ptr, pid_m, pid_n, N_total, num_pairs, up_offset, A_ROW_DIV, SILU_MUL,
        BLOCK_M, BLOCK_N,
    )  # fmt: skip
    acc, kt_start, kt_end = _expert_tile_sum(
        a_ptr, qw_ptr, scales_ptr, zeros_ptr, expert, a_rows, offs_n, rows, valid, mask_n, pid_k, split_k, K,
        num_pairs, group_size, stride_am, stride_qe, stride_qr, stride_se, stride_sg, stride_ze, stride_zg, BITS,
        KW, HAS_ZEROS, NG, SCALE_W, BLOCK_M, BLOCK_N, BLOCK_K, FAST, DOT_F32, EVEN_K, True,
    )  # fmt: skip
    if SILU_MUL:
        # The SiLU needs the whole K sum: each program leaves its partial in its own workspace slot;
        # the last of the tile's split_k programs to arrive (empty K ranges included: they store zeros
        # and count) sums the slots in slot order (deterministic) and runs the epilogue. Plain stores
        # into slots, not atomic adds into one zeroed tile: the workspace needs no zeroing (a per-call
        # torch.empty) and the sum's order does not depend on arrival order.
        ws_tile = ws_ptr + pairs.to(tl.int64)[None, :] * stride_wsm + (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]
        mask_ws = valid[None, :]  # [1, BM]: n_tiles * BLOCK_N == 2I columns, all in range
        tl.store(ws_tile + pid_k * stride_wsk, acc, mask=mask_ws)
        # Ordering (as w4a16_mma_triton._share_tile): the barrier orders every thread's partial
        # stores before the counter's gpu-scope release; the last program's acquire (same atomic)
        # then sees all split_k slots, and its .cg loads read them from L2, never a stale L1 line.
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for sk in range(0, split_k):
                total += tl.load(ws_tile + sk * stride_wsk, mask=mask_ws, other=0.0, cache_modifier=".cg")
            _silu_mul_store(total, c_ptr, pairs, valid, offs_out, N_out, stride_cm, BLOCK_N, BLOCK_M)
            # Reset for the next launch (and graph replay): every other program of the tile has
            # arrived, so nothing adds to it again in this launch.
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        # A weighted fp32 partial added straight into the token's row of the [T, H] result: the k-way
        # sum over the token's experts happens here too. Not rounded to the activation dtype per pair
        # (the full sum is not known here): one rounding, at the final cast.
        if kt_end > kt_start:  # an empty K range adds nothing
            weight = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0)  # [BM]
            res = acc * weight[None, :]  # [BN, BM]
            out_rows = (pairs // OUT_ROW_DIV).to(tl.int64)  # [BM]
            tl.atomic_add(
                c_ptr + out_rows[:, None] * stride_cm + offs_out[None, :],
                tl.trans(res),
                mask=valid[:, None] & (offs_out < N_out)[None, :],
                sem="relaxed",  # the kernel's end (CAST_OUT: the counter's release) orders them before the cast
            )
        if CAST_OUT:
            _arrive_then_cast(
                cnt_ptr, c_ptr, cast_ptr, pid_n, num_pairs // OUT_ROW_DIV, N_out, stride_cm, BLOCK_N, CAST_ROWS
            )


@triton.jit
def _arrive_then_cast(
    cnt_ptr,  # int32 [>= column tiles]: arrival counters, zero between launches
    acc_ptr,  # fp32 [T, H]: the down launch's accumulator
    out_ptr,  # [T, H], the activation dtype, same strides
    pid_n,
    num_rows,  # T
    N_out,
    stride_m,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
):
    """The down launch's cast, fused (``CAST_OUT``): every program of column tile ``pid_n`` (all pair
    blocks and K shares, idle ones included) arrives once after its atomic adds; the last one reads the
    tile's fp32 sums of all ``T`` rows and writes them in the activation dtype, the rounding the
    separate cast made, and resets the counter for the next launch (and graph replay)."""
    # Ordering as the gate_up tile's: the barrier orders every thread's adds before the counter's
    # gpu-scope release; the last program's acquire then sees them all, its .cg loads from L2.
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(2) - 1:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
        col_ok = cols < N_out
        for r0 in range(0, num_rows, ROWS):
            r = r0 + tl.arange(0, ROWS)  # [ROWS]
            offs = r.to(tl.int64)[:, None] * stride_m + cols[None, :]  # [ROWS, BN]
            mask = (r < num_rows)[:, None] & col_ok[None, :]
            total = tl.load(acc_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _prefetch_expert_tiles(
    qw_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    pid_m,
    pid_n,
    pid_k,
    split_k,
    K,
    stride_qe,
    stride_qr,
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
):
    """Before a PDL wait: the first ``TILES`` K-tiles of this program's share of its block's expert
    weight (storage rows of column tile ``pid_n``) into L2 (``w4a16_mma_triton._prefetch_k_tiles``), if
    the block has pairs (``num_padded``) and its share of K is not empty."""
    num_padded = tl.load(num_padded_ptr, cache_modifier=".cg")
    kt_start, kt_end = _k_share(pid_k, split_k, K, BLOCK_K)
    if (pid_m * BLOCK_M < num_padded) & (kt_end > kt_start):
        expert = tl.load(expert_ids_ptr + pid_m, cache_modifier=".cg").to(tl.int64)
        rows = pid_n * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)  # [BN / 4] storage rows
        count = tl.minimum(kt_end - kt_start, TILES)
        _prefetch_k_tiles(qw_ptr + expert * stride_qe, rows, stride_qr, kt_start, count, BITS, BLOCK_K)


@dataclass(frozen=True)
class MoEMmaConfig:
    block_m: int
    block_n: int  # weight columns per MMA tile (gate_up: half gate, half up)
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # programs along K per output tile, both GEMMs (> 1: the split-K launches)


SPLIT_K_ENV = "QSERVE_MOE_SPLIT_K"  # unset / "" / "auto": default_config's; "0" / "1": off; N: N
MAX_AUTO_SPLIT = 8
# Programs per SM the automatic split aims for at decode (the measured H100 decode grid, ~192 / ~256
# programs on 132 SMs, reads its weights at ~1/4 of the bandwidth floor: each program walks all of K).
AUTO_PROGRAMS_PER_SM = 4


FUSED_CAST_ENV = "QSERVE_MOE_FUSED_CAST"  # unset / "1": the split-K down launch casts its own output; "0": off


def fused_cast_requested() -> bool:
    """``QSERVE_MOE_FUSED_CAST``: "1" makes the split-K down launch write the layer's output in the
    activation dtype itself (each column tile's last program; ``_arrive_then_cast``), one launch fewer
    a layer than the torch cast after it; unset, empty or "1": on (the default since the H100 smoke and MoE
    run at 8c424b0, bench/RESULTS.md, nineteenth session); "0": off. Anything else is refused."""
    value = os.environ.get(FUSED_CAST_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{FUSED_CAST_ENV}={value!r}: expected 0 or 1")
    return value != "0"


def split_k_setting() -> int | str:
    """``QSERVE_MOE_SPLIT_K``: "auto" (the default: unset, empty or "auto"; on the H100 it made
    Qwen3-30B-A3B's batch-1 decode 1.02x, bench/RESULTS.md), 1 (off: "0" or "1"), or an integer >= 2.
    Anything else is refused (a typo must not quietly run, and get measured as, another launch)."""
    value = os.environ.get(SPLIT_K_ENV, "").strip()
    if value in ("", "auto"):
        return "auto"
    if value in ("0", "1"):
        return 1
    if value.isdigit() and int(value) >= 2:
        return int(value)
    raise ValueError(f"{SPLIT_K_ENV}={value!r}: expected unset, 0 or 1 (off), 'auto', or an integer split >= 2")


def default_config(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    split_k: int | str = 1,
    hidden: int = 0,
    inter: int = 0,
    num_sms: int = 132,
) -> MoEMmaConfig:
    """Untuned starting table: 16-row pair blocks and 64-column tiles while few pairs land on each
    expert (decode: more programs for a weight-bound step), 64 x 128 for prefill. bench/moe.py's
    ``mma`` column is where a measured table per architecture comes from.

    ``split_k`` (``split_k_setting()``): an integer is taken as is; ``"auto"`` splits only while an
    expert gets <= 2 pairs (then each hit expert is one 16-row block: ``min(T*k, E)`` blocks) into
    the smallest power of two that gives ``AUTO_PROGRAMS_PER_SM`` programs per SM on the GEMM with
    fewer column tiles (``hidden`` / ``inter`` the layer's H and I), at most ``MAX_AUTO_SPLIT`` and
    at most the down GEMM's K-tiles (I / 128). Measured at batch 1 only (bench/moe_sweep.py's split column tunes it)."""
    pairs_per_expert = num_tokens * top_k / max(num_experts, 1)
    if pairs_per_expert <= 16:
        cfg = MoEMmaConfig(block_m=16, block_n=64)
    else:
        cfg = MoEMmaConfig(block_m=64, block_n=128)
    if split_k == "auto":
        split_k = 1
        if pairs_per_expert <= 2 and hidden > 0 and inter > 0:
            blocks = min(num_tokens * top_k, num_experts)
            programs = blocks * min(inter // (cfg.block_n // 2), triton.cdiv(hidden, cfg.block_n))  # gate_up, down
            cap = min(MAX_AUTO_SPLIT, max(1, inter // cfg.block_k))
            while split_k * 2 <= cap and programs * split_k < AUTO_PROGRAMS_PER_SM * num_sms:
                split_k *= 2
    return dataclasses.replace(cfg, split_k=int(split_k))


def _launch_shape(cfg: MoEMmaConfig, weight: StackedMmaWeight, out_cols: int, silu_mul: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) this weight allows: K-tiles inside one group or holding whole groups (128
    preferred); column tiles that never read past the stored (64-padded) rows, and for gate_up
    halves that divide ``I`` (a tile never mixes gate and up columns of different offsets)."""
    g, k = weight.group_size, weight.in_features
    block_k = cfg.block_k if _block_k_ok(cfg.block_k, g, k) else (128 if _block_k_ok(128, g, k) else 64)
    block_n = max(cfg.block_n, 16 * cfg.num_warps)  # each warp owns >= 16 rows of the A operand
    if silu_mul:
        while out_cols % (block_n // 2):
            block_n //= 2
    elif weight.n_pad % block_n:
        block_n = MMA_PAD_N
    if block_n < 16 * cfg.num_warps or (silu_mul and (block_n // 2) % 16):
        raise ValueError(f"MoE MMA kernel: {out_cols} columns cannot be tiled with {cfg.num_warps} warps")
    return block_n, block_k


# Split-K arrival counters, per device: gate_up's one int32 per (pair block, column tile), then (after
# gate_up has reset them all) the fused-cast down launch's one per column tile. Shared by
# every layer (their launches run one after another in the stream, and each leaves its counters zero).
# Grown, never shrunk or freed: a CUDA graph captured earlier keeps the address it was captured with
# (``quant_kernels.device.arrival_counters``, this buffer's owner name below).
MIN_SPLIT_COUNTERS = 1 << 16  # 256 KB: a 2,048-token prefill at Qwen3-30B-A3B's shapes needs ~4.6K
SPLIT_COUNTERS_OWNER = "moe_mma_split"


def split_counters(device: torch.device, count: int) -> torch.Tensor:
    """int32 ``[>= count]`` arrival counters on ``device``, zero between launches: allocated (zeroed)
    once, then every launch's last program per tile resets its own, so no per-call memset."""
    return kdevice.arrival_counters(device, count, SPLIT_COUNTERS_OWNER, MIN_SPLIT_COUNTERS)


def _launch(
    a: torch.Tensor,  # [rows, K]
    weight: StackedMmaWeight,
    out: torch.Tensor,  # [T*k, N_out]; split-K down: fp32 [T, N_out], zero (``zero_out`` of the gate_up launch)
    out_cols: int,
    topk_weights: torch.Tensor,  # float32 [T*k]
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    silu_mul: bool,
    config: MoEMmaConfig,
    out_row_div: int = 1,  # split-K down: top_k (the k-way sum into ``out``'s token rows)
    zero_out: torch.Tensor | None = None,  # split-K gate_up: the down launch's fp32 [T, H] output, zeroed here
    cast_out: torch.Tensor | None = None,  # split-K down: [T, H] in x's dtype, ``out`` cast by the launch itself
) -> None:
    """``moe_mma_kernel`` (``config.split_k == 1``: the launch of 890e2ef, unchanged) or
    ``moe_mma_split_kernel``, which takes the same arguments first, then its own."""
    block_n, block_k = _launch_shape(config, weight, out_cols, silu_mul)
    g, k = weight.group_size, weight.in_features
    ng = groups_per_tile(block_k, g, k)
    has_zeros = weight.zeros is not None
    zeros = weight.zeros if has_zeros else kdevice.placeholder(a.device, torch.float16)
    stride_ze, stride_zg = (zeros.stride(0), zeros.stride(1)) if has_zeros else (0, 0)
    tile_cols = block_n // 2 if silu_mul else block_n
    grid = (sorted_ids.shape[0] // config.block_m, triton.cdiv(out_cols, tile_cols))
    args = (
        a, weight.qweight, weight.scales, zeros, out, topk_weights, sorted_ids, expert_ids, num_padded,
        weight.out_features, out_cols, k, num_pairs, out_cols if silu_mul else 0, g,
        a.stride(0), weight.qweight.stride(0), weight.qweight.stride(1), weight.scales.stride(0),
        weight.scales.stride(1), stride_ze, stride_zg, out.stride(0),
    )  # fmt: skip
    meta = dict(
        A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, BITS=weight.bits, KW=weight.kwidth, HAS_ZEROS=has_zeros, NG=ng,
        SCALE_W=ng > 1, BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k, FAST=not _INTERPRET,
        DOT_F32=_INTERPRET, EVEN_K=k % block_k == 0, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    split = config.split_k
    if split == 1:
        moe_mma_kernel[grid](*args, MUL_WEIGHT=not silu_mul, **meta)
        return
    # Every pointer argument has one dtype whatever the launch: the unused ones get typed placeholders.
    ws, cnt = kdevice.placeholder(a.device, torch.float32), kdevice.placeholder(a.device, torch.int32)
    stride_wsk = stride_wsm = 0
    if silu_mul:
        ws = torch.empty((split, num_pairs, weight.out_features), dtype=torch.float32, device=a.device)  # [S, T*k, 2I]
        stride_wsk, stride_wsm = ws.stride(0), ws.stride(1)
        cnt = split_counters(a.device, grid[0] * grid[1])
    elif out.dtype != torch.float32 or out_row_div < 1:
        raise ValueError("split-K down launch: out must be the zeroed float32 [T, H] accumulator")
    extra = {}
    if cast_out is not None:
        if silu_mul or cast_out.shape != out.shape or cast_out.stride() != out.stride():
            raise ValueError("split-K down launch: cast_out must be [T, H] with the accumulator's strides")
        cnt = split_counters(a.device, grid[1])  # one a column tile (gate_up left them zero)
        extra = dict(CAST_OUT=True, cast_ptr=cast_out)
    pdl = launch_options(a.device)
    if pdl and not silu_mul:  # down: its blocks are known before the wait (the kernel's PDL comment)
        extra["PDL_TILES"] = config.num_stages
    zero = zero_out if zero_out is not None else kdevice.placeholder(a.device, torch.float32)
    moe_mma_split_kernel[(*grid, split)](
        *args, ws, cnt, zero, 0 if zero_out is None else zero_out.numel(), split, stride_wsk, stride_wsm,
        OUT_ROW_DIV=out_row_div, ZERO_OUT=zero_out is not None, **meta, **extra, **pdl,
    )  # fmt: skip


def fused_moe_w4a16_mma(
    x: torch.Tensor,  # [T, H] fp16 / bf16
    w_gate_up: StackedMmaWeight,  # E experts of K=H, N=2I (gate | up)
    w_down: StackedMmaWeight,  # E experts of K=I, N=H
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
    config: MoEMmaConfig | None = None,
    skip_foreign: bool = False,
    layout: moe_reference.BlockLayout | None = None,  # blocks made already (moe_triton.block_layout): no sort
) -> torch.Tensor:  # [T, H]
    """Same result contract as ``moe_triton.fused_moe_w4a16`` (and ``moe_reference``'s): the
    one-launch token sort (``moe_triton.moe_align_block_size``), two launches and the k-way sum, no
    host sync. ``skip_foreign`` (expert parallelism): ids equal to ``num_experts`` sort past the
    computed blocks and their output rows stay zero. Without a ``config``, ``default_config`` with
    ``QSERVE_MOE_SPLIT_K`` (``split_k_setting``); with ``config.split_k > 1``, ``_split_k_moe``."""
    num_tokens, top_k = topk_ids.shape
    if config is None:
        split = split_k_setting()
        if split == 1:  # exactly the launches without split-K
            config = default_config(num_tokens, top_k, w_gate_up.num_experts)
        else:
            sms = kdevice.sm_count(x.device, default=132)
            hidden, inter = x.shape[1], w_down.in_features
            config = default_config(num_tokens, top_k, w_gate_up.num_experts, split, hidden, inter, sms)
    if config.split_k > 1:
        return _split_k_moe(x, w_gate_up, w_down, topk_weights, topk_ids, config, skip_foreign, layout)

    def launch(a, out, gate_up, weights, sorted_ids, expert_ids, num_padded, num_pairs, a_row_div):  # noqa: ANN001, ANN202
        weight, n = (w_gate_up, w_down.in_features) if gate_up else (w_down, x.shape[1])
        _launch(a, weight, out, n, weights, sorted_ids, expert_ids, num_padded, num_pairs, a_row_div, gate_up, config)

    return grouped_moe(
        x, topk_weights, topk_ids, w_gate_up.num_experts, w_down.in_features, config.block_m, skip_foreign, launch,
        layout,
    )  # fmt: skip


def _split_k_moe(
    x: torch.Tensor,  # [T, H] fp16 / bf16
    w_gate_up: StackedMmaWeight,
    w_down: StackedMmaWeight,
    topk_weights: torch.Tensor,  # float [T, k]
    topk_ids: torch.Tensor,  # int [T, k]
    config: MoEMmaConfig,
    skip_foreign: bool,
    layout: moe_reference.BlockLayout | None = None,  # blocks made already (the router's): no sort
) -> torch.Tensor:  # [T, H]
    """``moe_triton.grouped_moe``'s sequence with both GEMMs split along K: the sort (or ``layout``), gate_up (which
    also zeroes the down launch's fp32 accumulator: no memset launch; stream order puts it before
    the down launch, and CUDA-graph replays repeat it), down adding each pair's weighted partials into
    its token's row (the k-way sum), and the cast to the activation dtype in place of the torch sum.
    Foreign pairs (``skip_foreign``) sort past the computed blocks: their tokens' rows get nothing
    from them. Same launch count as without split-K, no host sync."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w_down.in_features
    sorted_ids, expert_ids, num_padded = block_layout(
        topk_ids, w_gate_up.num_experts, config.block_m, skip_foreign, layout
    )
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()  # [T*k]
    x = x.contiguous()
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [T*k, I]
    acc = torch.empty((num_tokens, hidden), dtype=torch.float32, device=x.device)  # [T, H], zeroed by gate_up
    _launch(
        x, w_gate_up, act, inter, weights, sorted_ids, expert_ids, num_padded, num_pairs, top_k, True, config,
        zero_out=acc,
    )  # fmt: skip
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device) if fused_cast_requested() else None
    _launch(
        act, w_down, acc, hidden, weights, sorted_ids, expert_ids, num_padded, num_pairs, 1, False, config,
        out_row_div=top_k, cast_out=out,
    )  # fmt: skip
    return acc.to(x.dtype) if out is None else out


def compile_for(
    arch: int,
    cfg: MoEMmaConfig,
    silu_mul: bool,
    dtype: str = "fp16",
    asym: bool = False,
    kwidth: int = 2,
    group_size: int = 128,
    top_k: int = 8,
    cast: bool = False,
    pdl: bool = False,
):
    """``moe_mma_kernel`` compiled for ``sm_<arch>`` without a GPU (``triton.compile`` with a
    ``GPUTarget``), with the argument types the launcher passes and the JIT's 16-byte
    specialization: ``.asm["ptx"]`` is what tests/kernels/test_moe_mma_ptx.py reads. ``cfg.split_k``
    > 1: ``moe_mma_split_kernel``'s launch (gate_up zeroing the down launch's accumulator; down into
    fp32; ``cast``: down writing its output in the activation dtype too; ``pdl``: launched with PDL,
    down prefetching its expert tiles before the wait)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    split = cfg.split_k > 1
    fn = moe_mma_split_kernel if split else moe_mma_kernel
    pointers = {
        "a_ptr": f"*{dtype}",
        "qw_ptr": "*i32",
        "scales_ptr": f"*{dtype}",
        "zeros_ptr": "*fp16",
        "c_ptr": f"*{dtype}",
        "topk_w_ptr": "*fp32",
        "sorted_ids_ptr": "*i32",
        "expert_ids_ptr": "*i32",
        "num_padded_ptr": "*i32",
    }
    ng = 1 if group_size % cfg.block_k == 0 else cfg.block_k // group_size
    constants = dict(
        group_size=group_size,
        A_ROW_DIV=top_k if silu_mul else 1,
        SILU_MUL=silu_mul,
        MUL_WEIGHT=not silu_mul,
        BITS=4,
        KW=kwidth,
        HAS_ZEROS=asym,
        NG=ng,
        SCALE_W=ng > 1,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        FAST=True,
        DOT_F32=False,
        EVEN_K=True,
    )
    if split:  # down always weights its partials: no MUL_WEIGHT
        pointers.update(c_ptr=f"*{dtype}" if silu_mul else "*fp32", ws_ptr="*fp32", cnt_ptr="*i32", zero_ptr="*fp32")
        del constants["MUL_WEIGHT"]
        constants.update(OUT_ROW_DIV=1 if silu_mul else top_k, ZERO_OUT=silu_mul, ZERO_BLOCK=256, CAST_ROWS=16)
        cast = cast and not silu_mul
        constants.update(CAST_OUT=cast, USE_PDL=pdl, PDL_TILES=cfg.num_stages if pdl and not silu_mul else 0)
        if cast:
            pointers["cast_ptr"] = f"*{dtype}"
        else:
            constants["cast_ptr"] = None
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in fn.arg_names}
    aligned = [
        (i,)
        for i, name in enumerate(fn.arg_names)
        if signature[name] != "constexpr" and name not in ("num_pairs", "split_k")
    ]
    return triton.compile(
        ASTSource(fn, signature, constants, {path: [["tt.divisibility", 16]] for path in aligned}),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )
