"""The stacked expert layout: one layer's experts as ONE tensor per field, experts along dim 0.

Knows: how the canonical ``PackedQuantWeight`` of ``quant_kernels.layout`` stacks over the
experts of a mixture-of-experts layer, and how one expert's slice reads back as a canonical
weight (a view, no copy). Must not know: checkpoint formats, routing, kernels.

``StackedQuantWeight`` for ``E`` experts of a linear ``y = x @ W_e`` (``W_e: [K, N]``):

* ``qweight``: int32 ``[E, K // pack_factor, N]`` (each ``[e]`` is the canonical K-packed layout);
* ``scales``: ``[E, num_groups, N]``;
* ``zeros``: ``None`` (symmetric, implicit zero ``2**(bits-1)``) or uint8 ``[E, num_groups, N]``;
* ``perm``: ``None`` or int64 ``[E, K]`` (act-order: each expert's own permutation; an expert
  without one holds the identity).

A fused gate_up weight holds each expert's gate columns ``[0, I)`` then its up columns
``[I, 2I)`` along N, as a dense fused ``gate_up_proj`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quant_kernels.layout import PackedQuantWeight, pack_factor


@dataclass
class StackedQuantWeight:
    bits: int
    group_size: int  # effective (per-channel: K)
    qweight: torch.Tensor  # int32 [E, K // pf, N]
    scales: torch.Tensor  # [E, num_groups, N]
    zeros: torch.Tensor | None = None  # uint8 [E, num_groups, N]; None = symmetric
    perm: torch.Tensor | None = None  # int64 [E, K]

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * pack_factor(self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[2]

    def expert(self, index: int) -> PackedQuantWeight:
        """Expert ``index`` as a canonical weight (views into the stacked tensors)."""
        return PackedQuantWeight(
            self.bits,
            self.group_size,
            self.qweight[index],
            self.scales[index],
            None if self.zeros is None else self.zeros[index],
            None if self.perm is None else self.perm[index],
        )

    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales, self.zeros, self.perm]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @staticmethod
    def empty_like_expert(first: PackedQuantWeight, num_experts: int, out_features: int) -> StackedQuantWeight:
        """Uninitialized storage for ``num_experts`` experts of ``out_features`` columns (a fused
        gate_up holds two shards of ``first``'s width), with ``first``'s dtypes and device."""
        device = first.qweight.device

        def stack(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            shape = (num_experts, *t.shape[:-1], out_features) if t.dim() == 2 else (num_experts, *t.shape)
            return torch.empty(shape, dtype=t.dtype, device=device)

        return StackedQuantWeight(
            first.bits,
            first.group_size,
            stack(first.qweight),
            stack(first.scales),
            stack(first.zeros),
            stack(first.perm),
        )

    def store(self, index: int, weight: PackedQuantWeight, what: str, col_start: int = 0) -> None:
        """Copy one expert's canonical weight into slot ``index``, columns from ``col_start``; a
        different shape, group size, bit width, symmetry or act-order from the layer's is refused
        naming ``what``. Shards of one fused weight must share their act-order permutation."""
        cols = weight.out_features
        same = (
            weight.bits,
            weight.group_size,
            weight.qweight.shape[0],
            weight.scales.shape[0],
            weight.scales.dtype,
        ) == (
            self.bits,
            self.group_size,
            self.qweight.shape[1],
            self.scales.shape[1],
            self.scales.dtype,
        ) and col_start + cols <= self.out_features
        if weight.perm is not None and self.perm is None:  # the first act-order expert: the others kept row order
            self.perm = torch.arange(self.in_features, device=self.qweight.device).repeat(self.num_experts, 1)
        if weight.perm is None and self.perm is not None:  # a trivial g_idx (or an RTN-fallback expert)
            weight = PackedQuantWeight(
                weight.bits, weight.group_size, weight.qweight, weight.scales, weight.zeros,
                torch.arange(self.in_features, device=self.qweight.device),
            )  # fmt: skip
        if not same or (weight.zeros is None) != (self.zeros is None):
            raise ValueError(
                f"{what}: expert weights of one layer must share bits, group size, shape, scale dtype, symmetry and "
                f"act-order; got {weight.bits}-bit g{weight.group_size} qweight {tuple(weight.qweight.shape)} "
                f"(zeros={'yes' if weight.zeros is not None else 'no'}, act-order={'yes' if weight.perm is not None else 'no'}), "
                f"the layer holds {self.bits}-bit g{self.group_size} {tuple(self.qweight.shape[1:])}"
            )
        self.qweight[index, :, col_start : col_start + cols].copy_(weight.qweight)
        self.scales[index, :, col_start : col_start + cols].copy_(weight.scales)
        if self.zeros is not None:
            self.zeros[index, :, col_start : col_start + cols].copy_(weight.zeros)
        if self.perm is not None:
            if col_start and not weight.perm.is_meta and not torch.equal(self.perm[index], weight.perm):
                raise ValueError(f"{what}: gate and up of one expert carry different act-order permutations")
            self.perm[index].copy_(weight.perm)
