"""Pure-PyTorch reference for multi-LoRA (Punica-style shrink / expand): the CPU path and the oracle
of ``quant_kernels.lora_triton``.

Knows: the stacked adapter layout and the numerics of ``y += scale * B(A(x))`` per token row, each
row with its own adapter slot. Must not know: models, layers, PEFT files or devices (every op runs on
whatever device its inputs are on).

Layout (one linear layer, ``L`` resident adapter slots, rank ``R`` = the configured maximum, ``S``
output slices: 3 for a fused qkv, 2 for gate_up, else 1):

- ``lora_a``: ``[L, S * R, K]``. Rows ``s*R : s*R + r`` are slice ``s``'s ``A`` (``[r, K]``, PEFT's
  ``lora_A.weight``); the rest of the ``R`` rows are zero (ranks below the maximum are padded).
- ``lora_b``: ``[L, N, R]``. Rows ``slice_starts[s] : slice_starts[s+1]`` hold slice ``s``'s ``B``
  (``[N_s, r]``, PEFT's ``lora_B.weight``) times the adapter's scale, zero-padded to ``R`` columns.
  A slice the adapter does not target is zero in both.
- ``token_slots``: int32 ``[T]``, each row's slot, ``-1`` for rows of the base model.

Numerics (shared with the kernels): the shrink accumulates in fp32 and rounds ``h = x @ A^T`` to the
activation dtype (as PEFT's ``lora_A`` module does); the expand accumulates ``h @ B^T`` in fp32 and
adds it to the base output in fp32 before one rounding. Rows of the base model are never written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Rows gathered at once: bounds the gathered ``[rows, S*R, K]`` adapter copy of the reference.
CHUNK_ROWS = 64


def lora_shrink(
    x: torch.Tensor,  # [T, K]
    lora_a: torch.Tensor,  # [L, S * R, K]
    token_slots: torch.Tensor,  # int32 [T], -1: base row
    out: torch.Tensor,  # [T, S * R], x's dtype: rows with a slot are written, the others left alone
) -> torch.Tensor:
    """``out[t] = x[t] @ lora_a[slot[t]]^T`` for every row with a slot (gather-based)."""
    for start in range(0, x.shape[0], CHUNK_ROWS):
        end = min(start + CHUNK_ROWS, x.shape[0])
        slots = token_slots[start:end].long()  # [c]
        a = lora_a[slots.clamp(min=0)].float()  # [c, S*R, K]
        h = torch.bmm(a, x[start:end].float().unsqueeze(-1)).squeeze(-1)  # [c, S*R]
        keep = (slots >= 0).unsqueeze(-1)  # [c, 1]
        out[start:end] = torch.where(keep, h.to(out.dtype), out[start:end])
    return out


def lora_expand(
    y: torch.Tensor,  # [T, N], updated in place
    h: torch.Tensor,  # [T, S * R]: lora_shrink's output
    lora_b: torch.Tensor,  # [L, N, R]
    token_slots: torch.Tensor,  # int32 [T], -1: base row
    slice_starts: Sequence[int],  # S + 1 bounds of the output slices along N
) -> torch.Tensor:
    """``y[t, slice s] += h[t, s*R:(s+1)*R] @ lora_b[slot[t], slice s]^T`` for every row with a slot."""
    rank = lora_b.shape[-1]
    for start in range(0, y.shape[0], CHUNK_ROWS):
        end = min(start + CHUNK_ROWS, y.shape[0])
        slots = token_slots[start:end].long()  # [c]
        keep = (slots >= 0).unsqueeze(-1)  # [c, 1]
        b_rows = lora_b[slots.clamp(min=0)]  # [c, N, R]
        for s in range(len(slice_starts) - 1):
            lo, hi = slice_starts[s], slice_starts[s + 1]
            hs = h[start:end, s * rank : (s + 1) * rank].float().unsqueeze(-1)  # [c, R, 1]
            delta = torch.bmm(b_rows[:, lo:hi].float(), hs).squeeze(-1)  # [c, N_s]
            part = y[start:end, lo:hi]
            y[start:end, lo:hi] = torch.where(keep, (part.float() + delta).to(y.dtype), part)
    return y
