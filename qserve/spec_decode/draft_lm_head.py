"""A 4-bit copy of the lm_head an EAGLE head drafts through (``speculative_config`` ``"draft_lm_head":
"int4"``): each draft's argmax reads about a quarter of the fp16 lm_head's bytes.

Why: at batch 1 a draft forward of a one-layer head reads its layer (about 0.55 GB at a 14B model's
width) and the whole lm_head (1.56 GB for a 152k vocabulary): the lm_head is most of a draft's cost.
Drafts are proposals: the target verifies them with its own lm_head, so a coarser copy changes which
tokens are proposed (the measured acceptance), never the outputs.

Knows: round-to-nearest group quantization (``qserve.quantize.quantizer.quantize_rtn``, asymmetric,
GPTQ's convention), the canonical packed layout and the W4A16 kernels' entry points. Must not know:
the head's layers, the proposer, the engine.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from qserve.quantize.quantizer import quantize_rtn
from quant_kernels import ops
from quant_kernels.layout import PackedQuantWeight, pack_codes

GROUP_SIZE = 128
_ROWS_PER_CHUNK = 16384  # vocabulary rows quantized at a time: bounds the transient copies at load


def group_size_for(hidden: int) -> int:
    """Groups of 128 inputs where the hidden size allows (every model this serves), else the largest
    power of two below 128 that divides it (tiny test models)."""
    group = math.gcd(hidden, GROUP_SIZE)
    if group < 8:
        raise ValueError(
            f"draft_lm_head 'int4': hidden size {hidden} is not a multiple of 8 (4-bit codes pack 8 a word)"
        )
    return group


def _half(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype the kernels multiply in: the model's, or float16 for a float32 model."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


@torch.no_grad()
def pack_int4_rtn(weight: torch.Tensor) -> PackedQuantWeight:
    """``weight [V, H]`` (an lm_head's, torch's orientation) as an asymmetric 4-bit RTN
    ``PackedQuantWeight`` (K = H, N = V) on the weight's device, a vocabulary chunk at a time."""
    vocab, hidden = weight.shape
    group_size = group_size_for(hidden)
    qweights, scales, zeros = [], [], []
    for start in range(0, vocab, _ROWS_PER_CHUNK):
        part = quantize_rtn(weight[start : start + _ROWS_PER_CHUNK], 4, group_size, sym=False)
        qweights.append(pack_codes(part.codes, 4))  # int32 [H / 8, n]
        scales.append(part.scales.to(_half(weight.dtype)))  # [H / G, n]
        zeros.append(part.zeros)  # uint8 [H / G, n]
    return PackedQuantWeight(4, group_size, torch.cat(qweights, 1), torch.cat(scales, 1), torch.cat(zeros, 1))


def prepare(weight: torch.Tensor) -> Any:
    """What ``logits`` multiplies by: the packed copy of ``weight [V, H]``, in the kernels' layout where
    they serve (CUDA)."""
    return ops.prepare_w4a16(pack_int4_rtn(weight))


# Rows a W4A16 call takes at once: the MMA dispatch's largest batch. Above it the kernels' dispatch
# dequantizes the whole weight for cuBLAS: [H, V] at 16 bits (1.56 GB for a 152k x 5,120 lm_head) in
# every call, and in the graph pool at capture. Larger batches go through in slices of these rows.
MAX_ROWS_PER_CALL = 128


def kernel_dtype(prepared: Any) -> torch.dtype:
    """The 16-bit dtype a copy multiplies in (its scales'), whatever the layout ``prepare`` gave it."""
    weight = prepared.weight if isinstance(prepared, ops.W4A16Prepared) else prepared
    return weight.scales.dtype


def logits(hidden: torch.Tensor, prepared: Any) -> torch.Tensor:
    """float32 ``[R, V]``: ``hidden [R, H]`` (a float32 model's cast to the copy's 16-bit dtype)
    through the 4-bit copy, ``MAX_ROWS_PER_CALL`` rows a call."""
    hidden = hidden.to(kernel_dtype(prepared))
    if hidden.shape[0] <= MAX_ROWS_PER_CALL:
        return ops.w4a16_linear(hidden, prepared).float()
    slices = [ops.w4a16_linear(part, prepared) for part in hidden.split(MAX_ROWS_PER_CALL)]  # each [<=128, V]
    return torch.cat(slices).float()


def planned_bytes(vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """Bytes the copy takes on the GPU for an lm_head ``[vocab, hidden]`` (``qserve plan``, before loading):
    codes, then scales and zeros in the 16-bit dtype (the MMA kernels' layout keeps its zeros at 16 bits; the
    canonical layout off CUDA at 8). The kernels' padding and scratch, a few KiB, are left out."""
    groups = hidden // group_size_for(hidden)
    element = torch.empty((), dtype=_half(dtype)).element_size()
    return vocab * hidden // 2 + 2 * groups * vocab * element
