"""Device dispatch for the per-token elementwise ops (RMSNorm, fused residual add + RMSNorm,
rotary embedding, alone or after the per-head RMSNorm of query and key, SiLU-and-mul): fused
Triton kernels on CUDA, the PyTorch reference elsewhere.

Knows: which implementation serves which device and dtype. Must not know: models or layers.
Triton stays an optional, lazy import: this module imports on a machine without triton, and
only the CUDA branch touches it. Semantics are those of ``quant_kernels.reference_elementwise``;
every op returns new tensors, never writes its inputs (but the paged cache a rotary op's
``kv_store`` names), and is safe to capture in a CUDA graph (no host sync, no data-dependent branch).
"""

from __future__ import annotations

import torch

from quant_kernels import device as kdevice
from quant_kernels import reference, reference_elementwise
from quant_kernels.kv_store import KVStore, check_kv_store

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_usable(*tensors: torch.Tensor) -> bool:
    """All on CUDA, floating dtypes the kernels serve, and triton importable."""
    return all(kdevice.triton_serves(t.device) and t.dtype in _KERNEL_DTYPES for t in tensors)


def rms_norm(
    x: torch.Tensor,  # [..., H], last dim contiguous for the kernel (anything else is copied first)
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [..., H], new and contiguous, x's dtype (when weight has it)
    """``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`` (HF Llama's RMSNorm)."""
    if _triton_usable(x, weight):
        from quant_kernels import elementwise_triton

        return elementwise_triton.rms_norm(x, weight, eps)
    return reference_elementwise.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [T, H], new_residual [T, H]), both new
    """``new_residual = x + residual`` (in x's dtype) and ``rms_norm(new_residual)`` in one pass."""
    if _triton_usable(x, residual, weight):
        from quant_kernels import elementwise_triton

        return elementwise_triton.fused_add_rms_norm(x, residual, weight, eps)
    return reference_elementwise.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor,  # int64 [T]
    query: torch.Tensor,  # [T, Hq, D], may be a strided view into a fused qkv tensor
    key: torch.Tensor,  # [T, Hk, D], likewise
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,  # float32 [max_positions, D / 2]
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (query [T, Hq, D], key [T, Hk, D]), new and contiguous
    """NeoX ("rotate half") rotary embedding of query and key at ``positions``: one launch on CUDA.
    With ``kv_store`` the rotated keys and its values also go to the paged cache (``_stored``)."""
    if _triton_usable(query, key, cos, sin) and kdevice.triton_serves(positions.device):
        from quant_kernels import elementwise_triton

        return elementwise_triton.rotary_embedding(positions, query, key, cos, sin, kv_store=kv_store)
    return _stored(reference_elementwise.rotary_embedding(positions, query, key, cos, sin), kv_store)


def qk_norm_rotary_embedding(
    positions: torch.Tensor,  # int64 [T]
    query: torch.Tensor,  # [T, Hq, D], may be a strided view into a fused qkv tensor
    key: torch.Tensor,  # [T, Hk, D], likewise
    q_weight: torch.Tensor,  # [D]: q_norm's weight
    k_weight: torch.Tensor,  # [D]: k_norm's weight
    eps: float,
    cos: torch.Tensor,  # float32 [max_positions, D / 2]
    sin: torch.Tensor,  # float32 [max_positions, D / 2]
    kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # (query [T, Hq, D], key [T, Hk, D]), new and contiguous
    """``rms_norm`` of every head of query and key, then ``rotary_embedding``: one launch on CUDA
    where the two norms and the rotary take three (the launch-bound decode step of a Qwen3 model:
    two launches fewer a layer); elsewhere exactly the reference norms and rotary. ``kv_store``: as
    ``rotary_embedding``'s."""
    if _triton_usable(query, key, q_weight, k_weight, cos, sin) and kdevice.triton_serves(positions.device):
        from quant_kernels import elementwise_triton

        return elementwise_triton.qk_norm_rotary_embedding(
            positions, query, key, q_weight, k_weight, eps, cos, sin, kv_store=kv_store
        )
    rotated = reference_elementwise.qk_norm_rotary_embedding(positions, query, key, q_weight, k_weight, eps, cos, sin)
    return _stored(rotated, kv_store)


def _stored(
    rotated: tuple[torch.Tensor, torch.Tensor],  # (query [T, Hq, D], key [T, Hk, D])
    kv_store: KVStore | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of a rotary op's ``kv_store``: the rotated keys and the values written by
    ``reference.store_kv`` after the rotation (what the fused launch does on CUDA)."""
    if kv_store is not None:
        query, key = rotated
        check_kv_store(kv_store, key.shape, key.dtype)
        reference.store_kv(key, kv_store.value, kv_store.key_cache, kv_store.value_cache, kv_store.slot_mapping)
    return rotated


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I], new and contiguous
    """``silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``."""
    if _triton_usable(gate_up):
        from quant_kernels import elementwise_triton

        return elementwise_triton.silu_and_mul(gate_up)
    return reference_elementwise.silu_and_mul(gate_up)
