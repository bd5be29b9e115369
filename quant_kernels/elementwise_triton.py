"""Triton kernels for the per-token elementwise ops of a decoder layer: RMSNorm (optionally fused
with the residual add before it), rotary embedding of query and key (optionally fused with the
per-head RMSNorm of both before it: Qwen3's q/k norms), and SiLU-and-mul.

Knows: the semantics of ``quant_kernels.reference_elementwise`` and how to lay these ops out as
one launch each. Must not know: models, layers, engines. Imported lazily (by
``quant_kernels.elementwise_ops`` on CUDA only, or by tests under ``TRITON_INTERPRET=1``).

Each op replaces a chain of 5-15 tiny torch kernels (casts, reductions, gathers, chunk/cat):
at decode sizes they are launch-bound, so one launch with one read and one write of each
row is the point; the arithmetic is all fp32 in registers.

Kernels
-------
``rms_norm_kernel``: grid ``(n0, n1)``, one program per row of ``H`` elements, the whole row in
  one ``BLOCK = next_power_of_2(H)`` masked tile. Rows are addressed through two leading strides,
  so a ``[T, heads, D]`` view into a fused qkv tensor (Qwen3's q/k norms) is read in place.
  With ``HAS_RESIDUAL`` it first forms ``x + residual``, rounds it to the activation dtype and
  writes it out (the new residual stream), then normalises the rounded sum, as the reference
  does. Rounding order matches Hugging Face: normalise in fp32, round to the activation dtype,
  multiply by the weight in fp32, round again.
``rotary_kernel``: grid ``(T, ceil(Hq / HPP) + ceil(Hk / HPP))``: a program owns ``HPP`` heads of
  one token, of query (first block indices) or of key (the rest), so query and key take one
  launch. It gathers that token's cos/sin row once and rotates ``[HPP, D/2]`` halves.
  With ``QK_NORM`` (``qk_norm_rotary_embedding``) each program first normalises its heads over
  their whole D (both halves, so a head is never split between programs) with
  ``rms_norm_kernel``'s rounding, then rotates those rounded values: the same math as q_norm,
  k_norm and the rotary as three launches, up to the fp32 reduction order of each head's sum of
  squares. Why: Qwen3-30B-A3B's decode at batch 1 is launch-bound (~785 CUDA-graph nodes a step),
  and this takes two launches off every layer (96 graph nodes over its 48 layers). The decoder
  uses it unless ``QSERVE_FUSED_QK_NORM_ROPE=0``.
``silu_and_mul_kernel``: grid ``(T, ceil(I / BLOCK))``: ``silu(gate) * up`` in fp32, rounded
  once (the reference, torch's ``F.silu(gate) * up``, rounds the SiLU first: results may differ
  by one ulp of the activation dtype).

Numerics: fp32 arithmetic throughout; the GPU compiler may contract ``a * b - c * d`` into an
FMA and reduces in another order than torch, so results agree with the reference to a few fp32
ulps before the final rounding (at most one ulp of fp16/bf16 after it), not bit for bit.

All launchers allocate their outputs with ``torch.empty`` (or take ``out=``), return early for
zero rows, and never synchronise with the host: they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from quant_kernels.kv_store import KVStore, check_kv_store
from quant_kernels.pdl import launch_options

SILU_BLOCK = 1024
ROTARY_TILE = 1024  # elements of query/key a rotary program handles (HPP * D)

# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def rms_norm_kernel(
    X,
    R,
    W,
    OUT,
    RES_OUT,
    n1,
    n_cols,
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # launched with PDL: wait for the kernel before first
):
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    i0 = tl.program_id(0).to(tl.int64)
    i1 = tl.program_id(1).to(tl.int64)
    row = i0 * n1 + i1  # outputs are contiguous [n0 * n1, H]
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + i0 * stride_x0 + i1 * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + i0 * stride_r0 + i1 * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * n_cols + cols, (normed * w).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    X,
    OUT,
    W,  # [2 * HALF] the heads' RMSNorm weight (read only with QK_NORM)
    t,
    first_head,
    n_heads,
    stride_t,
    stride_h,
    cos,  # fp32 [BLOCK_HALF]
    sin,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HPP: tl.constexpr,
    QK_NORM: tl.constexpr,
    CACHE=None,  # [num_blocks, block_size, n_heads, 2 * HALF] paged cache the rotated heads also go to (STORE)
    slot=0,  # the token's cache slot (STORE; negative: no store)
    block_size=1,
    stride_cb=0,
    stride_cs=0,
    STORE: tl.constexpr = False,
):
    heads = first_head + tl.arange(0, HPP)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (offs < HALF)[None, :]
    src = X + t * stride_t + heads[:, None].to(tl.int64) * stride_h + offs[None, :]
    if QK_NORM:
        x1 = tl.load(src, mask=mask, other=0.0)  # [HPP, BLOCK_HALF], X's dtype
        x2 = tl.load(src + HALF, mask=mask, other=0.0)
        # rms_norm_kernel's arithmetic over each whole head (both halves; masked lanes load 0 and
        # add nothing): normalise in fp32, round to X's dtype, multiply by the weight in fp32,
        # round to OUT's dtype. The rotation then reads these rounded values, as it would read
        # q_norm / k_norm's outputs from memory.
        x1f = x1.to(tl.float32)
        x2f = x2.to(tl.float32)
        sum_sq = tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)  # [HPP]
        rstd = tl.math.rsqrt(sum_sq / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1f * rstd).to(x1.dtype).to(tl.float32) * w1).to(OUT.dtype.element_ty).to(tl.float32)
        x2 = ((x2f * rstd).to(x2.dtype).to(tl.float32) * w2).to(OUT.dtype.element_ty).to(tl.float32)
    else:  # the loads and converts in the order the kernel had before QK_NORM (its default PTX unchanged)
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    dst = OUT + (t * n_heads + heads[:, None]) * (2 * HALF) + offs[None, :]
    if STORE:  # the values stored, also into the cache row of the token's slot (store_kv's model-dtype store)
        y1 = (x1 * c - x2 * s).to(OUT.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(OUT.dtype.element_ty)
        tl.store(dst, y1, mask=mask)
        tl.store(dst + HALF, y2, mask=mask)
        _store_cache_heads(CACHE, slot, block_size, stride_cb, stride_cs, heads, n_heads, offs, HALF, y1, y2)
    else:  # the stores as the kernel had them before STORE (its default PTX unchanged)
        tl.store(dst, (x1 * c - x2 * s).to(OUT.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, (x2 * c + x1 * s).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _store_cache_heads(
    CACHE,  # [num_blocks, block_size, n_heads, 2 * HALF], heads and dims contiguous
    slot,  # int64 scalar; negative: a pad row, nothing stored
    block_size,
    stride_cb,
    stride_cs,
    heads,  # int [HPP]
    n_heads,
    offs,  # int [BLOCK_HALF]
    HALF: tl.constexpr,
    y1,  # [HPP, BLOCK_HALF]: each head's first half
    y2,  # [HPP, BLOCK_HALF]: its second half
):
    # a negative slot masks every lane through a bound, never a broadcast scalar bool (store_kv_kernel's way)
    h_lim = tl.where(slot >= 0, n_heads, 0)
    mask = (heads < h_lim)[:, None] & (offs < HALF)[None, :]
    row = CACHE + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst = row + heads[:, None].to(tl.int64) * (2 * HALF) + offs[None, :]
    tl.store(dst, y1.to(CACHE.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, y2.to(CACHE.dtype.element_ty), mask=mask)


@triton.jit
def rotary_kernel(
    POS,
    Q,
    K,
    COS,
    SIN,
    Q_OUT,
    K_OUT,
    QW,  # [D] q_norm's weight (QK_NORM only; otherwise any pointer, never read)
    KW,  # [D] k_norm's weight
    n_q_heads,
    n_k_heads,
    n_q_blocks,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    HPP: tl.constexpr,
    QK_NORM: tl.constexpr = False,  # per-head RMSNorm of q and k (Qwen3's q_norm / k_norm) before rotating
    USE_PDL: tl.constexpr = False,  # launched with PDL: wait for the kernel before first
    # STORE_KV (below): the rotated keys and the values also go to the paged cache at the token's slot
    V=None,  # [T, Hk, D] values, any token / head strides
    K_CACHE=None,  # [num_blocks, block_size, Hk, D], the model dtype, heads and dims contiguous
    V_CACHE=None,
    SLOTS=None,  # int [T]; negative: a pad row, nothing stored
    n_k_blocks=0,  # programs of key heads; the value heads' programs follow them
    stride_vt=0,
    stride_vh=0,
    block_size=1,
    stride_kcb=0,
    stride_kcs=0,
    stride_vcb=0,
    stride_vcs=0,
    STORE_KV: tl.constexpr = False,
):
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    if STORE_KV:
        slot = tl.load(SLOTS + t).to(tl.int64)
        if block >= n_q_blocks + n_k_blocks:  # a value program: no rotation, its heads copied into the cache
            heads = (block - n_q_blocks - n_k_blocks) * HPP + tl.arange(0, HPP)
            offs = tl.arange(0, BLOCK_HALF)
            mask = (heads < n_k_heads)[:, None] & (offs < HALF)[None, :]
            src = V + t * stride_vt + heads[:, None].to(tl.int64) * stride_vh + offs[None, :]
            v1 = tl.load(src, mask=mask, other=0.0)  # [HPP, BLOCK_HALF]
            v2 = tl.load(src + HALF, mask=mask, other=0.0)
            _store_cache_heads(V_CACHE, slot, block_size, stride_vcb, stride_vcs, heads, n_k_heads, offs, HALF, v1, v2)
        else:
            _rotary_program(
                POS, Q, K, COS, SIN, Q_OUT, K_OUT, QW, KW, t, block, n_q_heads, n_k_heads, n_q_blocks,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, eps, HALF, BLOCK_HALF, HPP,
                QK_NORM, K_CACHE, slot, block_size, stride_kcb, stride_kcs, True,
            )  # fmt: skip
    else:  # the programs as the kernel had them before STORE_KV (its default sm90 PTX instructions unchanged)
        _rotary_program(
            POS, Q, K, COS, SIN, Q_OUT, K_OUT, QW, KW, t, block, n_q_heads, n_k_heads, n_q_blocks,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, eps, HALF, BLOCK_HALF, HPP, QK_NORM,
        )  # fmt: skip


@triton.jit
def _rotary_program(
    POS, Q, K, COS, SIN, Q_OUT, K_OUT, QW, KW, t, block, n_q_heads, n_k_heads, n_q_blocks,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin, eps,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HPP: tl.constexpr, QK_NORM: tl.constexpr,
    K_CACHE=None, slot=0, block_size=1, stride_kcb=0, stride_kcs=0, STORE_K: tl.constexpr = False,
):  # fmt: skip
    """One program of ``rotary_kernel``'s query or key heads (``STORE_K``: the keys also into ``K_CACHE``)."""
    pos = tl.load(POS + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(COS + pos * stride_cos + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(SIN + pos * stride_sin + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    if block < n_q_blocks:
        first = block * HPP
        _rotate_heads(
            Q, Q_OUT, QW, t, first, n_q_heads, stride_qt, stride_qh, cos, sin, eps, HALF, BLOCK_HALF, HPP, QK_NORM
        )
    else:
        first = (block - n_q_blocks) * HPP
        _rotate_heads(
            K, K_OUT, KW, t, first, n_k_heads, stride_kt, stride_kh, cos, sin, eps, HALF, BLOCK_HALF, HPP, QK_NORM,
            K_CACHE, slot, block_size, stride_kcb, stride_kcs, STORE_K,
        )  # fmt: skip


@triton.jit
def silu_mul(gate, up):
    """``silu(gate) * up`` of fp32 tiles: the SiLU-and-mul's numerics, shared with the LoRA kernel that
    fuses gate_up's expand into it (``lora_triton.lora_expand_silu_mul_kernel``)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def silu_and_mul_kernel(GU, OUT, n_cols, stride_row, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # launched with PDL (quant_kernels.pdl): nothing is touched before the kernel before ends
        gdc_wait()
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(GU + row * stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = silu_mul(gate, up)
    tl.store(OUT + row * n_cols + cols, y.to(OUT.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _norm_warps(block: int) -> int:
    # ~16-32 elements per thread at large H (four 16-byte loads of fp16 per thread at H=5120);
    # a single warp for head-sized rows (q/k norms), where programs are many and short.
    if block >= 4096:
        return 8
    if block >= 1024:
        return 4
    if block >= 512:
        return 2
    return 1


def _row_view(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """``(x', n0, n1, stride0, stride1)``: x' addresses row ``(i0, i1)`` at ``i0*s0 + i1*s1``, H contiguous.

    Up to two leading dims are read in place with their own strides; a view the kernel cannot
    address (last stride not 1, more leading dims that do not flatten) is copied first.
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 1, 0, 0
    if x.dim() == 2:
        return x, x.shape[0], 1, x.stride(0), 0
    if x.dim() > 3:
        x = x.reshape(-1, x.shape[-1])  # a view when the leading dims flatten, else a copy
        return x, x.shape[0], 1, x.stride(0), 0
    return x, x.shape[0], x.shape[1], x.stride(0), x.stride(1)


def rms_norm(
    x: torch.Tensor,  # [..., H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out: torch.Tensor | None = None,  # [..., H] contiguous, dtype promote(x, weight)
) -> torch.Tensor:  # [..., H], contiguous
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` in one launch."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    xv, n0, n1, s0, s1 = _row_view(x)
    n_cols = x.shape[-1]
    if n0 * n1 == 0 or n_cols == 0:
        return out
    block = triton.next_power_of_2(n_cols)
    rms_norm_kernel[(n0, n1)](
        xv,
        xv,
        weight.contiguous(),
        out,
        out,
        n1,
        n_cols,
        s0,
        s1,
        0,
        0,
        eps,
        HAS_RESIDUAL=False,
        BLOCK=block,
        **launch_options(out.device),
        num_warps=_norm_warps(block),
    )
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    out: torch.Tensor | None = None,  # [T, H] contiguous, dtype promote(x, weight)
    residual_out: torch.Tensor | None = None,  # [T, H] contiguous, x's dtype
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new_residual [T, H])
    """``new_residual = (x + residual)`` rounded to x's dtype, and ``rms_norm(new_residual)``."""
    n_cols = x.shape[-1]
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual_out is None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, n_cols) if x.stride(-1) == 1 else x.contiguous().view(-1, n_cols)  # [T, H]
    r2 = residual.reshape(-1, n_cols) if residual.stride(-1) == 1 else residual.contiguous().view(-1, n_cols)
    rows = x2.shape[0]
    if rows == 0 or n_cols == 0:
        return out, residual_out
    block = triton.next_power_of_2(n_cols)
    rms_norm_kernel[(rows, 1)](
        x2,
        r2,
        weight.contiguous(),
        out,
        residual_out,
        1,
        n_cols,
        x2.stride(0),
        0,
        r2.stride(0),
        0,
        eps,
        HAS_RESIDUAL=True,
        BLOCK=block,
        **launch_options(out.device),
        num_warps=_norm_warps(block),
    )
    return out, residual_out


def rotary_embedding(
    positions: torch.Tensor,  # int [T]
    query: torch.Tensor,  # [T, Hq, D], any token / head strides
    key: torch.Tensor,  # [T, Hk, D], any token / head strides
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,  # float32 [max_positions, D / 2]
    q_out: torch.Tensor | None = None,  # [T, Hq, D] contiguous, query's dtype
    k_out: torch.Tensor | None = None,  # [T, Hk, D] contiguous, key's dtype
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (query [T, Hq, D], key [T, Hk, D]), contiguous
    """NeoX rotary embedding of query and key at ``positions``, both in one launch; with ``kv_store``
    the same launch also writes the rotated keys and the values into the paged cache (``STORE_KV``)."""
    return _rotary(positions, query, key, cos, sin, None, q_out, k_out, kv_store)


def qk_norm_rotary_embedding(
    positions: torch.Tensor,  # int [T]
    query: torch.Tensor,  # [T, Hq, D], any token / head strides
    key: torch.Tensor,  # [T, Hk, D], any token / head strides
    q_weight: torch.Tensor,  # [D] q_norm's weight
    k_weight: torch.Tensor,  # [D] k_norm's weight
    eps: float,
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,  # float32 [max_positions, D / 2]
    q_out: torch.Tensor | None = None,  # [T, Hq, D] contiguous, dtype promote(query, q_weight)
    k_out: torch.Tensor | None = None,  # [T, Hk, D] contiguous, dtype promote(key, k_weight)
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (query [T, Hq, D], key [T, Hk, D]), contiguous
    """``rotary_embedding(positions, rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps), cos, sin)``
    (each head normalised over its D dims) in the one launch of ``rotary_embedding``, with the norms'
    rounding: q_norm, k_norm and rotary's three launches become one (``rotary_kernel``'s ``QK_NORM``)."""
    return _rotary(positions, query, key, cos, sin, (q_weight, k_weight, eps), q_out, k_out, kv_store)


def _rotary(
    positions: torch.Tensor,  # int [T]
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hk, D]
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,  # (q_weight [D], k_weight [D], eps)
    q_out: torch.Tensor | None,
    k_out: torch.Tensor | None,
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one launcher of ``rotary_kernel``, with (``qk_norm``) or without the heads' RMSNorm, and
    with (``kv_store``) or without the cache store of the keys and values."""
    num_tokens, n_q_heads, head_dim = query.shape
    n_k_heads = key.shape[1]
    q_dtype, k_dtype = query.dtype, key.dtype
    if qk_norm is not None:  # as rms_norm: a float32 weight on 16-bit activations gives float32 (torch's promotion)
        q_weight, k_weight, eps = qk_norm
        q_dtype, k_dtype = torch.promote_types(q_dtype, q_weight.dtype), torch.promote_types(k_dtype, k_weight.dtype)
    if q_out is None:
        q_out = torch.empty(query.shape, dtype=q_dtype, device=query.device)
    if k_out is None:
        k_out = torch.empty(key.shape, dtype=k_dtype, device=key.device)
    if kv_store is not None:
        check_kv_store(kv_store, key.shape, k_out.dtype)
    if num_tokens == 0 or head_dim == 0:
        return q_out, k_out
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    if qk_norm is None:
        q_weight, k_weight, eps = cos, cos, 0.0  # placeholders: QK_NORM=False never reads them
    else:
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    hpp = max(1, min(ROTARY_TILE // (2 * block_half), triton.next_power_of_2(max(n_q_heads, n_k_heads))))
    n_q_blocks = triton.cdiv(n_q_heads, hpp)
    n_k_blocks = triton.cdiv(n_k_heads, hpp)
    store = {}
    if kv_store is not None:  # the value heads' programs after the key heads'
        value = kv_store.value if kv_store.value.stride(-1) == 1 else kv_store.value.contiguous()
        store = dict(
            V=value, K_CACHE=kv_store.key_cache, V_CACHE=kv_store.value_cache, SLOTS=kv_store.slot_mapping,
            n_k_blocks=n_k_blocks, stride_vt=value.stride(0), stride_vh=value.stride(1),
            block_size=kv_store.key_cache.shape[1], stride_kcb=kv_store.key_cache.stride(0),
            stride_kcs=kv_store.key_cache.stride(1), stride_vcb=kv_store.value_cache.stride(0),
            stride_vcs=kv_store.value_cache.stride(1), STORE_KV=True,
        )  # fmt: skip
    grid = (num_tokens, n_q_blocks + n_k_blocks * (2 if kv_store is not None else 1))
    rotary_kernel[grid](
        positions,
        query,
        key,
        cos,
        sin,
        q_out,
        k_out,
        q_weight,
        k_weight,
        n_q_heads,
        n_k_heads,
        n_q_blocks,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos.stride(0),
        sin.stride(0),
        eps,
        HALF=half,
        BLOCK_HALF=block_half,
        HPP=hpp,
        QK_NORM=qk_norm is not None,
        **store,
        **launch_options(q_out.device),
        num_warps=4 if hpp * block_half >= 256 else 1,
    )
    return q_out, k_out


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2I]
    out: torch.Tensor | None = None,  # [T, I] contiguous, gate_up's dtype
) -> torch.Tensor:  # [T, I]
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``, in fp32, rounded once."""
    n_cols = gate_up.shape[-1] // 2
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], n_cols), dtype=gate_up.dtype, device=gate_up.device)
    gu = gate_up.reshape(-1, gate_up.shape[-1])  # [T, 2I]
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    rows = gu.shape[0]
    if rows == 0 or n_cols == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(n_cols))
    silu_and_mul_kernel[(rows, triton.cdiv(n_cols, block))](
        gu,
        out,
        n_cols,
        gu.stride(0),
        BLOCK=block,
        **launch_options(out.device),
        num_warps=4 if block >= 512 else 1,
    )
    return out
