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

The default MoE kernel on CUDA (``QSERVE_MOE_KERNEL=fused`` leaves it; read in ``quant_kernels.moe_ops``):
it won every row of bench/moe.py on the H200 and the H100.
Untuned: one starting config per M bucket (``default_config``), no split-K (a decode step of
Qwen3-30B-A3B launches ~8 pair blocks x 24 column tiles for gate_up), no stream-K, no PDL.
4-bit, no act-order; other layers keep the other paths.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quant_kernels import device as kdevice
from quant_kernels import moe_reference
from quant_kernels import w4a16_mma_triton as mma
from quant_kernels.moe_layout import StackedQuantWeight
from quant_kernels.moe_triton import grouped_moe  # the sort, the two launches' buffers, the k-way sum
from quant_kernels.repack import MMA_PAD_N, MmaQuantWeight, mma_kwidth, mma_zeros
from quant_kernels.w4a16_mma_triton import _accumulate, _block_k_ok

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
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_m * BLOCK_M >= num_padded:
        return
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
    acc = _accumulate(
        a_ptr,
        qw_ptr + expert * stride_qe,
        scales_ptr + expert * stride_se,
        zeros_ptr + expert * stride_ze,
        qw_ptr,  # the permutation: never read (HAS_PERM=False)
        a_rows,
        offs_n,
        rows,
        valid,
        mask_n,
        0,
        tl.cdiv(K, BLOCK_K),
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
    dtype = c_ptr.dtype.element_ty
    if SILU_MUL:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, HALF, BLOCK_M)), (1, 2, 0)))  # [HALF, BM] each
        # rounded to the activation dtype first, as the unfused gate_up output would be
        gate = gate.to(dtype).to(tl.float32)
        res = gate / (1.0 + tl.exp(-gate)) * up.to(dtype).to(tl.float32)
    else:
        res = acc
        if MUL_WEIGHT:
            weight = tl.load(topk_w_ptr + pairs, mask=valid, other=0.0)  # [BM]
            res = res.to(dtype).to(tl.float32) * weight[None, :]
    tl.store(
        c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_out[None, :],
        tl.trans(res).to(dtype),
        mask=valid[:, None] & (offs_out < N_out)[None, :],
    )


@dataclass(frozen=True)
class MoEMmaConfig:
    block_m: int
    block_n: int  # weight columns per MMA tile (gate_up: half gate, half up)
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_tokens: int, top_k: int, num_experts: int) -> MoEMmaConfig:
    """Untuned starting table: 16-row pair blocks and 64-column tiles while few pairs land on each
    expert (decode: more programs for a weight-bound step), 64 x 128 for prefill. bench/moe.py's
    ``mma`` column is where a measured table per architecture comes from."""
    pairs_per_expert = num_tokens * top_k / max(num_experts, 1)
    if pairs_per_expert <= 16:
        return MoEMmaConfig(block_m=16, block_n=64)
    return MoEMmaConfig(block_m=64, block_n=128)


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


def _launch(
    a: torch.Tensor,  # [rows, K]
    weight: StackedMmaWeight,
    out: torch.Tensor,  # [T*k, N_out]
    out_cols: int,
    topk_weights: torch.Tensor,  # float32 [T*k]
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    num_pairs: int,
    a_row_div: int,
    silu_mul: bool,
    config: MoEMmaConfig,
) -> None:
    block_n, block_k = _launch_shape(config, weight, out_cols, silu_mul)
    g, k = weight.group_size, weight.in_features
    ng = 1 if (g % block_k == 0 or g >= k) else block_k // g
    has_zeros = weight.zeros is not None
    zeros = weight.zeros if has_zeros else kdevice.placeholder(a.device, torch.float16)
    stride_ze, stride_zg = (zeros.stride(0), zeros.stride(1)) if has_zeros else (0, 0)
    tile_cols = block_n // 2 if silu_mul else block_n
    grid = (sorted_ids.shape[0] // config.block_m, triton.cdiv(out_cols, tile_cols))
    moe_mma_kernel[grid](
        a, weight.qweight, weight.scales, zeros, out, topk_weights, sorted_ids, expert_ids, num_padded,
        weight.out_features, out_cols, k, num_pairs, out_cols if silu_mul else 0, g,
        a.stride(0), weight.qweight.stride(0), weight.qweight.stride(1), weight.scales.stride(0),
        weight.scales.stride(1), stride_ze, stride_zg, out.stride(0),
        A_ROW_DIV=a_row_div, SILU_MUL=silu_mul, MUL_WEIGHT=not silu_mul, BITS=weight.bits, KW=weight.kwidth,
        HAS_ZEROS=has_zeros, NG=ng, SCALE_W=ng > 1, BLOCK_M=config.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FAST=not _INTERPRET, DOT_F32=_INTERPRET, EVEN_K=k % block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
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
    computed blocks and their output rows stay zero."""
    num_tokens, top_k = topk_ids.shape
    config = config or default_config(num_tokens, top_k, w_gate_up.num_experts)

    def launch(a, out, gate_up, weights, sorted_ids, expert_ids, num_padded, num_pairs, a_row_div):  # noqa: ANN001, ANN202
        weight, n = (w_gate_up, w_down.in_features) if gate_up else (w_down, x.shape[1])
        _launch(a, weight, out, n, weights, sorted_ids, expert_ids, num_padded, num_pairs, a_row_div, gate_up, config)

    return grouped_moe(
        x, topk_weights, topk_ids, w_gate_up.num_experts, w_down.in_features, config.block_m, skip_foreign, launch,
        layout,
    )  # fmt: skip


def compile_for(
    arch: int,
    cfg: MoEMmaConfig,
    silu_mul: bool,
    dtype: str = "fp16",
    asym: bool = False,
    kwidth: int = 2,
    group_size: int = 128,
    top_k: int = 8,
):
    """``moe_mma_kernel`` compiled for ``sm_<arch>`` without a GPU (``triton.compile`` with a
    ``GPUTarget``), with the argument types the launcher passes and the JIT's 16-byte
    specialization: ``.asm["ptx"]`` is what tests/kernels/test_moe_mma_ptx.py reads."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = moe_mma_kernel
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
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in fn.arg_names}
    aligned = [(i,) for i, name in enumerate(fn.arg_names) if signature[name] != "constexpr" and name != "num_pairs"]
    return triton.compile(
        ASTSource(fn, signature, constants, {path: [["tt.divisibility", 16]] for path in aligned}),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )
