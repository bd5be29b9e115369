"""Triton W4A16 / W8A16 kernels: fused dequant-GEMM (decode and tiled) and a dequantize kernel.

Knows: the canonical packed layout (``quant_kernels.layout``, read as is: int32 ``[K/pf, N]``
packed along K, N contiguous, so a thread reads 16 contiguous bytes of 4 columns), how to tile
it, and which launch configuration serves which ``(M, K, N)`` on which device. Must not know:
models, checkpoint formats, or engines. Imported lazily by ``quant_kernels.ops`` on CUDA only.

Kernels
-------
``w4a16_gemm_kernel``: ``out[M, N] = x[:, perm] @ dequant(W)`` with fp32 accumulation.
  Each program owns a ``BLOCK_M x BLOCK_N`` output tile and a K-slice (split-K). It loads int32
  words ``[BLOCK_K/pf, BLOCK_N]`` coalesced along N and never unpacks them into a ``[BLOCK_K,
  BLOCK_N]`` tile: for each code position ``j`` (a compile-time loop) the codes ``(w >> bits*j) &
  mask`` are the packed rows ``pf*kw + j``; they are multiplied with the matching strided
  columns of x (gathered through ``perm`` for act-order). Codes become floats through the
  2**23 exponent trick (``(q | 0x4B000000)`` reinterpreted as fp32 is ``2**23 + q``, minus
  ``2**23 + zero``: exact ``q - zero`` in two integer/float ops, no slow int->float convert).
  ``USE_DOT=False``: CUDA-core FMAs into a ``[BLOCK_M, BLOCK_K/pf, BLOCK_N]`` accumulator,
  reduced once at the end (GEMV, M <= ~4). ``USE_DOT=True``: tensor-core ``tl.dot`` per
  code position (small and medium M). Scales are applied once per K-tile when the tile lies in
  one group (``SCALE_PER_TILE``: ``group_size % BLOCK_K == 0``), else gathered per word row
  (any group size that is a multiple of 8 -- P16). Split-K partials go to an fp32 workspace;
  the last program of a tile (atomic counter) sums them, adds bias and writes the output, then
  resets its counter: one launch, no memset, no host work.
``w4a16_dequant_kernel``: dense ``[K, N]`` weight in the activation dtype, rows scattered back
  to input order through ``perm``; the large-M path then calls cuBLAS (``x @ W``).

Dispatch (``w4a16_gemm``) picks a ``W4A16Config`` from M (a Python int taken from ``x.shape``):
a tuned entry from ``_TUNED`` (filled by ``tune_w4a16`` before any CUDA-graph capture, keyed by
device, shape and M bucket) or the built-in table measured on an H200. No host sync, no
allocation-dependent decisions, so calls are safe to capture in a CUDA graph once compiled.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quant_kernels.layout import PackedQuantWeight, pack_factor

# Under TRITON_INTERPRET=1 (CPU tests) bf16 tl.dot gives garbage in Triton 3.6's interpreter.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def w4a16_gemm_kernel(
    x_ptr,  # [M, K] fp16 / bf16
    qw_ptr,  # int32 [K // PF, N]
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # uint8 [num_groups, N] (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    bias_ptr,  # [N] (unused when not HAS_BIAS)
    out_ptr,  # [M, N] x dtype
    ws_ptr,  # fp32 [split_k, M, N] split-K partials (unused when not USE_SPLIT)
    cnt_ptr,  # int32 [>= num tiles] zero-initialised arrival counters (unused when not USE_SPLIT)
    M,
    N,
    K,
    group_size,
    split_k,
    stride_xm,
    stride_xk,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_om,
    stride_on,
    stride_wsk,
    stride_wsm,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_PER_TILE: tl.constexpr,
    USE_DOT: tl.constexpr,
    SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    BLOCK_KW: tl.constexpr = BLOCK_K // PF  # int32 word rows per K-tile
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000  # fp32 bits of 2**23
    SYM_ZERO: tl.constexpr = 8388608.0 + (1 << (BITS - 1))  # 2**23 + implicit zero
    dtype = x_ptr.dtype.element_ty
    if DOT_F32:  # interpreter only: its bf16 tl.dot is wrong, so dot operands go as fp32 there
        dot_dtype = tl.float32
    else:
        dot_dtype = dtype

    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_m = offs_m < M
    mask_n = offs_n < N
    num_kw = K // PF
    num_k_tiles = (K + BLOCK_K - 1) // BLOCK_K
    tiles_per_split = (num_k_tiles + split_k - 1) // split_k
    kt_start = pid_k * tiles_per_split
    kt_end = tl.minimum(kt_start + tiles_per_split, num_k_tiles)

    if USE_DOT:
        if SWAP_AB:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)

    for kt in range(kt_start, kt_end):
        offs_kw = kt * BLOCK_KW + tl.arange(0, BLOCK_KW)  # [BLOCK_KW] word rows
        mask_kw = offs_kw < num_kw
        mask_w = mask_kw[:, None] & mask_n[None, :]
        w = tl.load(qw_ptr + offs_kw[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask_w, other=0)
        # Scales and the fp32 "2**23 + zero" per tile ([1, BLOCK_N]) or per word row ([BLOCK_KW, BLOCK_N]).
        if SCALE_PER_TILE:
            g = (kt * BLOCK_K) // group_size
            s = tl.load(scales_ptr + g * stride_sg + offs_n * stride_sn, mask=mask_n, other=0.0)
            s = s.to(tl.float32)[None, :]  # [1, BLOCK_N]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g * stride_zg + offs_n * stride_zn, mask=mask_n, other=0)
                zm = (z.to(tl.int32) | MAGIC).to(tl.float32, bitcast=True)[None, :]  # [1, BLOCK_N]
            else:
                zm = SYM_ZERO
        else:
            g_rows = (offs_kw * PF) // group_size  # [BLOCK_KW]: all PF codes of a word share a group
            s = tl.load(scales_ptr + g_rows[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask_w, other=0.0)
            s = s.to(tl.float32)  # [BLOCK_KW, BLOCK_N]
            if HAS_ZEROS:
                z = tl.load(zeros_ptr + g_rows[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=mask_w, other=0)
                zm = (z.to(tl.int32) | MAGIC).to(tl.float32, bitcast=True)  # [BLOCK_KW, BLOCK_N]
            else:
                zm = SYM_ZERO

        if USE_DOT:
            if SCALE_PER_TILE:
                if SWAP_AB:
                    part = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                else:
                    part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            part3 = tl.zeros((BLOCK_M, BLOCK_KW, BLOCK_N), dtype=tl.float32)

        for j in tl.static_range(PF):
            q = (w >> (BITS * j)) & CODE_MASK  # [BLOCK_KW, BLOCK_N] codes of packed rows PF*kw + j
            qz = (q | MAGIC).to(tl.float32, bitcast=True) - zm  # exact q - zero
            k_idx = offs_kw * PF + j  # [BLOCK_KW] packed row index
            if HAS_PERM:
                k_src = tl.load(perm_ptr + k_idx, mask=mask_kw, other=0)
            else:
                k_src = k_idx
            x_mask = mask_m[:, None] & mask_kw[None, :]
            xj = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_src[None, :] * stride_xk, mask=x_mask, other=0.0)
            if USE_DOT:
                xj = xj.to(dot_dtype)
                if SCALE_PER_TILE:
                    b = qz.to(dot_dtype)  # small exact integers
                    if SWAP_AB:
                        part = tl.dot(tl.trans(b), tl.trans(xj), part)
                    else:
                        part = tl.dot(xj, b, part)
                else:
                    b = (qz * s).to(dtype).to(dot_dtype)
                    if SWAP_AB:
                        acc = tl.dot(tl.trans(b), tl.trans(xj), acc)
                    else:
                        acc = tl.dot(xj, b, acc)
            else:
                part3 += xj.to(tl.float32)[:, :, None] * qz[None, :, :]  # [BLOCK_M, BLOCK_KW, BLOCK_N]

        if USE_DOT:
            if SCALE_PER_TILE:
                if SWAP_AB:
                    acc += part * tl.trans(s)
                else:
                    acc += part * s
        else:
            acc3 += part3 * s[None, :, :]

    if USE_DOT:
        if SWAP_AB:
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        acc = tl.sum(acc3, axis=1)  # [BLOCK_M, BLOCK_N]

    mask_mn = mask_m[:, None] & mask_n[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(dtype), mask=mask_mn)
    else:
        ws_tile = ws_ptr + offs_m[:, None] * stride_wsm + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
        tl.store(ws_tile + pid_k * stride_wsk, acc, mask=mask_mn)
        tl.debug_barrier()  # every thread's partial is written before the release below
        tile_id = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(cnt_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # last program of this tile: reduce, add bias, write, reset
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sk in range(0, split_k):
                total += tl.load(ws_tile + sk * stride_wsk, mask=mask_mn, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(dtype), mask=mask_mn)
            tl.atomic_xchg(cnt_ptr + tile_id, 0, sem="relaxed", scope="gpu")


@triton.jit
def w4a16_dequant_kernel(
    qw_ptr,  # int32 [K // PF, N]
    scales_ptr,  # [num_groups, N]
    zeros_ptr,  # uint8 [num_groups, N] (unused when not HAS_ZEROS)
    perm_ptr,  # int64 [K] (unused when not HAS_PERM)
    out_ptr,  # [K, N] dense weight in input row order
    N,
    K,
    group_size,
    stride_qk,
    stride_qn,
    stride_sg,
    stride_sn,
    stride_zg,
    stride_zn,
    stride_ok,
    stride_on,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    CODE_MASK: tl.constexpr = (1 << BITS) - 1
    MAGIC: tl.constexpr = 0x4B000000
    SYM_ZERO: tl.constexpr = 8388608.0 + (1 << (BITS - 1))
    dtype = out_ptr.dtype.element_ty

    offs_kw = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)  # [BLOCK_KW]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask_kw = offs_kw < K // PF
    mask = mask_kw[:, None] & (offs_n < N)[None, :]
    w = tl.load(qw_ptr + offs_kw[:, None] * stride_qk + offs_n[None, :] * stride_qn, mask=mask, other=0)
    g_rows = (offs_kw * PF) // group_size
    s = tl.load(scales_ptr + g_rows[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=mask, other=0.0)
    s = s.to(tl.float32)
    if HAS_ZEROS:
        z = tl.load(zeros_ptr + g_rows[:, None] * stride_zg + offs_n[None, :] * stride_zn, mask=mask, other=0)
        zm = (z.to(tl.int32) | MAGIC).to(tl.float32, bitcast=True)
    else:
        zm = SYM_ZERO
    for j in tl.static_range(PF):
        q = (w >> (BITS * j)) & CODE_MASK
        val = ((q | MAGIC).to(tl.float32, bitcast=True) - zm) * s  # [BLOCK_KW, BLOCK_N]
        rows = offs_kw * PF + j
        if HAS_PERM:
            rows = tl.load(perm_ptr + rows, mask=mask_kw, other=0)
        tl.store(out_ptr + rows[:, None] * stride_ok + offs_n[None, :] * stride_on, val.to(dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """One launch configuration. ``kind``: "fused" (w4a16_gemm_kernel) or "dequant" (+ cuBLAS)."""

    kind: str = "fused"
    use_dot: bool = False
    swap_ab: bool = False
    block_m: int = 1
    block_n: int = 128
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2

    def short(self) -> str:
        if self.kind == "dequant":
            return "dequant+mm"
        mode = ("dotT" if self.swap_ab else "dot") if self.use_dot else "fma"
        return f"{mode} m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k} w{self.num_warps} st{self.num_stages}"


DEQUANT = W4A16Config(kind="dequant")

# Tuned configs: (device index, K, N, bits, group_size, dtype, m_bucket) -> config. Filled by
# ``tune_w4a16`` (or ``set_config``) before CUDA-graph capture; read-only on the hot path.
_TUNED: dict[tuple, W4A16Config] = {}

# Split-K reduction uses per-tile counters; the prepared weight holds this many per N-column of
# tiles at the smallest BLOCK_N allowed to split (see ``num_split_counters``).
MAX_SPLIT_M_TILES = 4
MIN_SPLIT_BLOCK_N = 32


def num_split_counters(n: int) -> int:
    """Arrival counters a weight of N columns needs for every split-K config we launch."""
    return triton.cdiv(n, MIN_SPLIT_BLOCK_N) * MAX_SPLIT_M_TILES


def m_bucket(m: int) -> int:
    """Power-of-two bucket of M used as the config-cache key (1, 2, 4, ... 4096, then capped)."""
    return min(1 << max(0, (m - 1).bit_length()), 8192)


def _fix(cfg: W4A16Config, m: int, k: int, n: int, bits: int) -> W4A16Config:
    """Clamp a config to what the kernel allows for this problem (valid for any M in the bucket)."""
    if cfg.kind != "fused":
        return cfg
    pf = pack_factor(bits)
    block_k = cfg.block_k
    while block_k > 16 and block_k // pf > max(1, triton.next_power_of_2(k // pf)):
        block_k //= 2
    if cfg.use_dot:
        block_k = max(block_k, 16 * pf)
    split = cfg.split_k
    num_k_tiles = triton.cdiv(k, block_k)
    split = max(1, min(split, num_k_tiles))
    if split > 1 and (cfg.block_n < MIN_SPLIT_BLOCK_N or triton.cdiv(m, cfg.block_m) > MAX_SPLIT_M_TILES):
        split = 1
    return dataclasses.replace(cfg, block_k=block_k, split_k=split)


def default_config(m: int, k: int, n: int, bits: int, group_size: int) -> W4A16Config:
    """Built-in choice by M (measured on an H200 with Qwen2.5-14B shapes; see bench/RESULTS.md)."""
    num_sms = 132
    if m <= 4:
        block_m = triton.next_power_of_2(m)
        block_n = 128 if m == 1 else 64
        cfg = W4A16Config(use_dot=False, block_m=block_m, block_n=block_n, block_k=256 // block_m, num_stages=2)
    elif m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        cfg = W4A16Config(use_dot=True, block_m=block_m, block_n=64, block_k=128, num_warps=4, num_stages=3)
    elif m <= 256:
        cfg = W4A16Config(use_dot=True, block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
    else:
        return DEQUANT
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, cfg.block_m)
    split = 1
    while tiles * split < 2 * num_sms and split < 8:
        split *= 2
    return _fix(dataclasses.replace(cfg, split_k=split), m, k, n, bits)


def _key(device: torch.device, k: int, n: int, bits: int, group_size: int, dtype: torch.dtype, m: int) -> tuple:
    return (device.index if device.type == "cuda" else -1, k, n, bits, group_size, dtype, m_bucket(m))


def set_config(
    weight: PackedQuantWeight, dtype: torch.dtype, m: int, cfg: W4A16Config, device: torch.device | None = None
) -> None:
    """Pin the config for this weight's shape and M bucket (used by tuning and benchmarks)."""
    device = device or weight.qweight.device
    k, n = weight.in_features, weight.out_features
    _TUNED[_key(device, k, n, weight.bits, weight.group_size, dtype, m)] = cfg


def select_config(weight: PackedQuantWeight, dtype: torch.dtype, m: int) -> W4A16Config:
    """Pure dict lookup + arithmetic: safe on the hot path and under CUDA-graph capture."""
    k, n = weight.in_features, weight.out_features
    cfg = _TUNED.get(_key(weight.qweight.device, k, n, weight.bits, weight.group_size, dtype, m))
    if cfg is None:
        cfg = default_config(m, k, n, weight.bits, weight.group_size)
    return _fix(cfg, m, k, n, weight.bits)


def candidate_configs(m: int, k: int, n: int, bits: int) -> list[W4A16Config]:
    """Configs worth timing for this M (the benchmark and ``tune_w4a16`` sweep these)."""
    out: list[W4A16Config] = []
    splits = (1, 2, 4, 8)
    if m <= 4:
        block_m = triton.next_power_of_2(m)
        for block_n, block_k in ((64, 256), (64, 512), (128, 128), (128, 256), (256, 128)):
            for split in splits:
                out.append(W4A16Config("fused", False, False, block_m, block_n, block_k // block_m, split, 4, 2))
    if 2 <= m <= 128:
        block_m = max(16, triton.next_power_of_2(min(m, 64)))
        for swap in (False, True):
            for block_n in (64, 128):
                for split in splits:
                    out.append(W4A16Config("fused", True, swap, block_m, block_n, 128, split, 4, 3))
    if m >= 64:
        for block_m, block_n, warps in ((64, 128, 4), (128, 128, 8), (128, 256, 8), (64, 256, 4)):
            out.append(W4A16Config("fused", True, False, block_m, block_n, 128, 1, warps, 3))
        out.append(DEQUANT)
    uniq: list[W4A16Config] = []
    for cfg in out:
        cfg = _fix(cfg, m, k, n, bits)
        if cfg not in uniq:
            uniq.append(cfg)
    return uniq


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def dequantize_dense(weight: PackedQuantWeight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense ``[K, N]`` weight in *input* row order (perm undone), in ``dtype``."""
    k, n = weight.in_features, weight.out_features
    if out is None:
        out = torch.empty((k, n), dtype=dtype, device=weight.qweight.device)  # [K, N]
    block_kw, block_n = 16, 128
    grid = (triton.cdiv(k // pack_factor(weight.bits), block_kw), triton.cdiv(n, block_n))
    qw, sc = weight.qweight, weight.scales
    zeros = weight.zeros if weight.zeros is not None else sc
    perm = weight.perm if weight.perm is not None else qw
    w4a16_dequant_kernel[grid](
        qw,
        sc,
        zeros,
        perm,
        out,
        n,
        k,
        weight.group_size,
        qw.stride(0),
        qw.stride(1),
        sc.stride(0),
        sc.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        out.stride(0),
        out.stride(1),
        BITS=weight.bits,
        HAS_ZEROS=weight.zeros is not None,
        HAS_PERM=weight.perm is not None,
        BLOCK_KW=block_kw,
        BLOCK_N=block_n,
        num_warps=4,
    )
    return out


def w4a16_gemm(
    x: torch.Tensor,  # [M, K] fp16 / bf16
    weight: PackedQuantWeight,
    bias: torch.Tensor | None = None,  # [N]
    config: W4A16Config | None = None,
    counters: torch.Tensor | None = None,  # int32 [>= num_split_counters(N)], zeros; reused across calls
    out: torch.Tensor | None = None,  # [M, N]
) -> torch.Tensor:
    """``x[:, perm] @ dequant(weight) + bias`` on CUDA (or under TRITON_INTERPRET=1); returns ``[M, N]``."""
    m, k = x.shape
    n = weight.out_features
    if k != weight.in_features:
        raise ValueError(f"x has K={k}, weight has in_features={weight.in_features}")
    cfg = select_config(weight, x.dtype, m) if config is None else _fix(config, m, k, n, weight.bits)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return out
    if cfg.kind == "dequant":
        dense = dequantize_dense(weight, x.dtype)  # [K, N] input order: no gather of x
        if bias is None:
            return torch.mm(x, dense, out=out)
        return torch.addmm(bias.to(x.dtype), x, dense, out=out)

    split = cfg.split_k
    num_pid_m = triton.cdiv(m, cfg.block_m)
    num_pid_n = triton.cdiv(n, cfg.block_n)
    if split > 1:
        ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device)  # [SPLIT_K, M, N]
        if counters is None:
            counters = torch.zeros(num_pid_m * num_pid_n, dtype=torch.int32, device=x.device)
        elif counters.numel() < num_pid_m * num_pid_n:
            raise ValueError(f"counters hold {counters.numel()} entries, need {num_pid_m * num_pid_n}")
    else:
        ws = out
        counters = out
    qw, sc = weight.qweight, weight.scales
    zeros = weight.zeros if weight.zeros is not None else sc
    perm = weight.perm if weight.perm is not None else qw
    bias_arg = bias if bias is not None else sc
    grid = (num_pid_n, split, num_pid_m)
    w4a16_gemm_kernel[grid](
        x,
        qw,
        sc,
        zeros,
        perm,
        bias_arg,
        out,
        ws,
        counters,
        m,
        n,
        k,
        weight.group_size,
        split,
        x.stride(0),
        x.stride(1),
        qw.stride(0),
        qw.stride(1),
        sc.stride(0),
        sc.stride(1),
        zeros.stride(0),
        zeros.stride(1),
        out.stride(0),
        out.stride(1),
        ws.stride(0) if split > 1 else 0,
        ws.stride(1) if split > 1 else 0,
        BITS=weight.bits,
        HAS_ZEROS=weight.zeros is not None,
        HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None,
        SCALE_PER_TILE=weight.group_size % cfg.block_k == 0,
        USE_DOT=cfg.use_dot,
        SWAP_AB=cfg.swap_ab,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        USE_SPLIT=split > 1,
        DOT_F32=_INTERPRET and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def tune_w4a16(
    weight: PackedQuantWeight,
    dtype: torch.dtype,
    ms: list[int],
    counters: torch.Tensor | None = None,
    rep_ms: int = 20,
) -> dict[int, W4A16Config]:
    """Time ``candidate_configs`` for each M and pin the fastest (call before graph capture)."""
    from triton.testing import do_bench

    chosen: dict[int, W4A16Config] = {}
    k, n = weight.in_features, weight.out_features
    for m in ms:
        x = torch.randn((m, k), dtype=dtype, device=weight.qweight.device)  # [M, K]
        best: tuple[float, W4A16Config] | None = None
        for cfg in candidate_configs(m, k, n, weight.bits):
            try:
                t = do_bench(lambda cfg=cfg, x=x: w4a16_gemm(x, weight, None, cfg, counters), rep=rep_ms)
            except Exception:  # a config the compiler rejects (resources) is skipped
                continue
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            set_config(weight, dtype, m, best[1])
            chosen[m] = best[1]
    return chosen
