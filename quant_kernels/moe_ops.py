"""Device dispatch for a mixture-of-experts layer's experts: which implementation runs them.

Knows: the four ways the experts of one layer run and when each applies —

* off CUDA: the PyTorch reference (``moe_reference``), the CPU path and the oracle;
* on CUDA by default: the grouped kernel on experts pre-shuffled once here to the MMA-operand
  order of the dense W4A16 kernel (``moe_mma_triton``: swap-AB, the dequantized weights stay in
  registers), no host sync, CUDA-graph safe; the canonical stack is not kept
  (``PreparedExperts.kind == "mma"``). 1.5-2.3x the kernel below per layer and 1.33-1.67x its
  Qwen3-30B-A3B decode on the H200 (bench/RESULTS.md). Split-K along K
  (``moe_mma_triton.split_k_setting``: ``QSERVE_MOE_SPLIT_K`` unset or "auto", the default, splits
  only at decode, a few pairs per expert; an integer N >= 2 always; "0" or "1" never): the down
  launch adds weighted fp32 partials into the token rows, gate_up reduces its partials in the last
  program of a tile before the SiLU; anything else is refused at load;
* on CUDA with ``QSERVE_MOE_KERNEL=fused``, or where the MMA kernel does not serve a layer: the
  fused grouped kernel on the canonical stack (``moe_triton``, per-element dequantize), likewise
  sync-free (44-259x the loop below on the H200);
* on CUDA with ``QSERVE_FUSED_MOE=0`` (whatever ``QSERVE_MOE_KERNEL`` says): the reference's
  loop over the experts a step hits, each expert's two matmuls through the dense W4A16 kernels
  (``ops.w4a16_linear``, weights repacked per expert once here) and
  ``elementwise_ops.silu_and_mul``. Learning which experts are hit costs one host sync per layer,
  so such a model runs without CUDA graphs (``PreparedExperts.graph_safe``).

The router's softmax + top-k (``select_experts``): on CUDA one Triton launch (``moe_router_triton``;
``QSERVE_FUSED_ROUTER=0`` opts out), else the reference's torch ops. ``route`` is what a
MoE block calls: that choice, the ids as one expert-parallel rank's (``local_expert_ids``), and
for steps of at most ``QSERVE_MOE_DIRECT_BLOCKS`` (token, expert) pairs (default 32; "0" turns it
off) the grouped kernels' block layout with one pair per block, written by the router's
launch (``moe_router_triton.router_topk_blocks``), so ``moe_experts`` launches no token sort
(``Routing.layout``). It needs the fused router and grouped experts (``mma`` or the fused
kernel) on CUDA; elsewhere it does not apply (building the layout with torch ops would cost more
launches than the one sort it saves).

``route_hidden`` is what the MoE block calls: the router's logits (``F.linear`` in the model dtype, as
in transformers) and ``route``. Unless ``QSERVE_FUSED_ROUTER_GEMM=0``
(``fused_router_gemm_requested``), on the steps that take the direct layout above, the logits and the
choice + layout are one launch (``moe_router_triton.router_gemm_topk_blocks``) instead of two (the
cuBLAS router GEMM, ~5 µs at one token on the H200, then the router's): 48 fewer graph nodes per
decode step of Qwen3-30B-A3B (its batch-1 decode 336.0 tok/s against 328.5 with the two launches, H100,
bench/RESULTS.md, sixteenth session). Elsewhere (or with the switch off) ``route_hidden`` is
``F.linear`` + ``route``. ``route`` stays for callers that already have logits (bench/moe.py).

Must not know: models, checkpoint formats. Triton stays a lazy import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from quant_kernels import device as kdevice
from quant_kernels import elementwise_ops, moe_reference, ops
from quant_kernels.moe_layout import StackedQuantWeight
from quant_kernels.switches import env_switch

FUSED_MOE_ENV = "QSERVE_FUSED_MOE"
MOE_KERNEL_ENV = "QSERVE_MOE_KERNEL"  # "mma" (default): moe_mma_triton; "fused": moe_triton
MOE_KERNELS = ("mma", "fused")
FUSED_ROUTER_ENV = "QSERVE_FUSED_ROUTER"  # "0": the router's torch ops instead of its one launch (moe_router_triton)
# "1" / unset: the router's GEMM in the same launch as the direct layout's top-k (route_hidden); "0" off
FUSED_ROUTER_GEMM_ENV = "QSERVE_FUSED_ROUTER_GEMM"
# N > 0: steps of at most N (token, expert) pairs take the router's one-pair-per-block layout (route)
DIRECT_BLOCKS_ENV = "QSERVE_MOE_DIRECT_BLOCKS"
# The default N: Qwen3-30B-A3B's top-8 for 1-4 tokens (1.08x at batch 1 with split-K on the H100, RESULTS).
DEFAULT_DIRECT_BLOCKS = 32


def fused_router_requested() -> bool:
    """On unless ``QSERVE_FUSED_ROUTER=0`` (the reference's torch ops, kept as the measured baseline);
    a value other than 0 or 1 is refused (``prepare_experts`` reads it, so a typo stops the load)."""
    return env_switch(FUSED_ROUTER_ENV, default=True)


def fused_router_gemm_requested() -> bool:
    """On unless ``QSERVE_FUSED_ROUTER_GEMM=0`` (``route_hidden``: the router GEMM fused into the direct
    layout's launch; +2.3% at Qwen3-30B-A3B batch 1 on the H100); a value other than 0 or 1 is refused
    (``prepare_experts`` reads it, so a typo stops the load)."""
    return env_switch(FUSED_ROUTER_GEMM_ENV, default=True)


def fused_moe_requested() -> bool:
    """On unless ``QSERVE_FUSED_MOE=0`` (the per-expert loop, kept as the measured baseline)."""
    return os.environ.get(FUSED_MOE_ENV, "1") != "0"


def mma_moe_requested() -> bool:
    """The MMA-operand kernel unless ``QSERVE_MOE_KERNEL=fused`` (unset or empty: ``mma``); anything
    else is refused at load (a misspelt choice must not silently measure the wrong kernel)."""
    value = os.environ.get(MOE_KERNEL_ENV, "") or "mma"
    if value not in MOE_KERNELS:
        raise ValueError(f"{MOE_KERNEL_ENV}={value!r}: the MoE kernels to choose are 'mma' (the default) and 'fused'")
    return value == "mma"


def direct_blocks_limit() -> int:
    """``QSERVE_MOE_DIRECT_BLOCKS`` as the most (token, expert) pairs a step may have to skip the
    token sort (``route``): unset or empty: ``DEFAULT_DIRECT_BLOCKS`` (32: Qwen3-30B-A3B's top-8 up to
    4 tokens); "0": off; a positive integer as is. Anything else is refused, naming the variable (a typo must not
    silently measure the sorted path). Meant for a handful of tokens: the router's one program then
    holds every token's logits, and an expert hit by several pairs is read once per pair."""
    value = os.environ.get(DIRECT_BLOCKS_ENV, "").strip()
    if not value:
        return DEFAULT_DIRECT_BLOCKS
    if not value.isdigit():
        raise ValueError(f"{DIRECT_BLOCKS_ENV}={value!r}: 0 (off) or a positive number of (token, expert) pairs")
    return int(value)


@dataclass
class PreparedExperts:
    """One layer's experts as their implementation consumes them (``kind``):

    ``"dense"``: ``gate_up`` [E, 2I, H] and ``down`` [E, H, I] tensors; ``"stacked"``: canonical
    ``StackedQuantWeight``s (reference, or the fused kernel when ``fused``); ``"mma"``:
    ``moe_mma_triton.StackedMmaWeight``s (always fused); ``"per_expert"``: one
    ``ops.prepare_w4a16`` result per expert in ``gate_up_list`` / ``down_list``."""

    kind: str
    num_experts: int
    intermediate_size: int
    gate_up: Any = None  # torch.Tensor | StackedQuantWeight | None
    down: Any = None
    gate_up_list: list[Any] = field(default_factory=list)
    down_list: list[Any] = field(default_factory=list)
    fused: bool = False
    # Expert parallelism: these are one rank's experts, and ``moe_experts`` may get the sentinel id
    # ``num_experts`` (``moe_reference.local_expert_ids``) for pairs routed to another rank's.
    skip_foreign: bool = False

    @property
    def graph_safe(self) -> bool:
        """Whether running these experts needs no host sync (so a CUDA graph can hold them)."""
        return self.fused

    def nbytes(self) -> int:
        from quant_kernels.ops import W4A16Prepared  # noqa: PLC0415

        def size(obj: Any) -> int:
            if isinstance(obj, torch.Tensor):
                return obj.numel() * obj.element_size()
            if isinstance(obj, StackedQuantWeight):
                return obj.nbytes()
            if isinstance(obj, W4A16Prepared):
                return size(obj.weight.qweight) + size(obj.weight.scales) + size(getattr(obj.weight, "zeros", None))
            if hasattr(obj, "nbytes") and callable(obj.nbytes):
                return obj.nbytes()
            return 0

        return size(self.gate_up) + size(self.down) + sum(size(p) for p in self.gate_up_list + self.down_list)


def prepare_experts(
    gate_up: torch.Tensor | StackedQuantWeight,
    down: torch.Tensor | StackedQuantWeight,
    skip_foreign: bool = False,
) -> PreparedExperts:
    """Turn one layer's loaded experts (on their device) into what ``moe_experts`` consumes;
    ``skip_foreign``: they are one rank's share of the layer's experts (expert parallelism)."""
    direct_blocks_limit()  # a misspelt QSERVE_MOE_DIRECT_BLOCKS stops the load, not the first step
    fused_router_requested()  # and so does a misspelt QSERVE_FUSED_ROUTER
    fused_router_gemm_requested()  # or QSERVE_FUSED_ROUTER_GEMM
    if isinstance(gate_up, torch.Tensor):
        return PreparedExperts(
            "dense", gate_up.shape[0], down.shape[-1], gate_up=gate_up, down=down, skip_foreign=skip_foreign
        )
    num_experts, inter = gate_up.num_experts, down.in_features
    device = gate_up.qweight.device
    if not kdevice.triton_serves(device):
        return PreparedExperts("stacked", num_experts, inter, gate_up=gate_up, down=down, skip_foreign=skip_foreign)
    grouped = fused_moe_requested()  # QSERVE_FUSED_MOE=0: the per-expert loop, whichever kernel is named
    if mma_moe_requested() and grouped:
        from quant_kernels import moe_mma_triton, moe_router_triton  # noqa: PLC0415

        moe_mma_triton.split_k_setting()  # a misspelt QSERVE_MOE_SPLIT_K stops the load, not the first step
        moe_mma_triton.fused_cast_requested()  # and so does a misspelt QSERVE_MOE_FUSED_CAST
        moe_router_triton.packed_topk_requested()  # or QSERVE_MOE_PACKED_TOPK
        if moe_mma_triton.supports(gate_up, down):
            return PreparedExperts(
                "mma",
                num_experts,
                inter,
                gate_up=moe_mma_triton.prepare_stacked(gate_up),
                down=moe_mma_triton.prepare_stacked(down),
                fused=True,
                skip_foreign=skip_foreign,
            )
    if grouped:
        from quant_kernels import moe_triton  # noqa: PLC0415

        if moe_triton.supports(gate_up) and moe_triton.supports(down):
            return PreparedExperts(
                "stacked", num_experts, inter, gate_up=gate_up, down=down, fused=True, skip_foreign=skip_foreign
            )
    return PreparedExperts(
        "per_expert",
        num_experts,
        inter,
        gate_up_list=[ops.prepare_w4a16(gate_up.expert(e)) for e in range(num_experts)],
        down_list=[ops.prepare_w4a16(down.expert(e)) for e in range(num_experts)],
        skip_foreign=skip_foreign,
    )


def select_experts(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, k], int32 [T, k]
    """The router's choice (``moe_reference.select_experts``' contract): on a device Triton serves
    one launch (``moe_router_triton``; ``QSERVE_FUSED_ROUTER=0`` opts out), else the reference's torch
    ops (about six launches)."""
    if fused_router_requested() and kdevice.triton_serves(router_logits.device):
        from quant_kernels import moe_router_triton  # noqa: PLC0415

        return moe_router_triton.router_topk(router_logits, top_k, renormalize)
    return moe_reference.select_experts(router_logits, top_k, renormalize)


@dataclass(frozen=True)
class Routing:
    """The router's choice as ``moe_experts`` takes it (plain tensors): ``ids`` index the block's own
    experts (another rank's expert: the sentinel ``num_experts`` of the stack); ``layout``, when
    ``route`` made one, the grouped kernels' blocks for these pairs (no token sort then)."""

    weights: torch.Tensor  # float32 [T, k]
    ids: torch.Tensor  # int32 [T, k]
    layout: moe_reference.BlockLayout | None = None


def _grouped_block_m(prepared: PreparedExperts, num_tokens: int, top_k: int) -> int | None:
    """The ``block_m`` the grouped kernel ``moe_experts`` will run ``prepared`` with at this step
    (its launcher's own ``default_config``), or None when the experts take no grouped kernel."""
    if prepared.kind == "mma":
        from quant_kernels import moe_mma_triton  # noqa: PLC0415

        return moe_mma_triton.default_config(num_tokens, top_k, prepared.num_experts).block_m
    if prepared.kind == "stacked" and prepared.fused:
        from quant_kernels import moe_triton  # noqa: PLC0415

        return moe_triton.default_config(num_tokens, top_k, prepared.num_experts).block_m
    return None


def _direct_block_m(prepared: PreparedExperts, num_tokens: int, top_k: int, device: torch.device) -> int | None:
    """The ``block_m`` of the router's one-pair-per-block layout at this step (``route``'s conditions:
    ``0 < T * k <= QSERVE_MOE_DIRECT_BLOCKS``, the fused router, a device Triton serves, grouped
    experts), or None where the step takes no such layout."""
    if 0 < num_tokens * top_k <= direct_blocks_limit() and fused_router_requested() and kdevice.triton_serves(device):
        return _grouped_block_m(prepared, num_tokens, top_k)
    return None


def _share(prepared: PreparedExperts, num_experts: int, expert_start: int) -> tuple[int, int]:
    """``(expert_start, num_local)`` of the experts ``prepared`` holds among the layer's ``num_experts``
    (all of them unless ``skip_foreign``), as the router kernels take them."""
    if prepared.skip_foreign:
        return expert_start, prepared.num_experts
    return 0, num_experts


def route(
    router_logits: torch.Tensor,  # [T, E], E the layer's experts (all ranks')
    top_k: int,
    renormalize: bool,
    prepared: PreparedExperts,
    expert_start: int = 0,  # the first expert ``prepared`` holds (expert parallelism)
) -> Routing:
    """``select_experts``, with the ids turned into ``prepared``'s own when it holds a share of the
    experts (``skip_foreign``: ``moe_reference.local_expert_ids``). With ``QSERVE_MOE_DIRECT_BLOCKS=N`` (default 32),
    the fused router (not ``QSERVE_FUSED_ROUTER=0``), ``T * k <= N`` and a grouped kernel on a device Triton serves, the
    router's one launch also lays the pairs out one per block for that kernel's ``block_m``
    (``moe_reference.direct_block_layout``' contract): ``Routing.layout``. Host-side decisions from
    the shapes and the environment only: no host sync, CUDA-graph safe (a graph bucket's T fixes it)."""
    num_tokens, num_experts = router_logits.shape
    block_m = _direct_block_m(prepared, num_tokens, top_k, router_logits.device)
    if block_m is not None:
        from quant_kernels import moe_router_triton  # noqa: PLC0415

        start, num_local = _share(prepared, num_experts, expert_start)
        weights, ids, sorted_ids, expert_ids, num_padded = moe_router_triton.router_topk_blocks(
            router_logits, top_k, renormalize, block_m, start, num_local
        )
        return Routing(weights, ids, moe_reference.BlockLayout(sorted_ids, expert_ids, num_padded, block_m))
    weights, ids = select_experts(router_logits, top_k, renormalize)
    if prepared.skip_foreign:
        ids = moe_reference.local_expert_ids(ids, expert_start, prepared.num_experts)
    return Routing(weights, ids)


def route_hidden(
    hidden: torch.Tensor,  # [T, H] the MoE block's input, in the model dtype
    router_weight: torch.Tensor,  # [E, H] the router (``gate.weight``), E the layer's experts (all ranks')
    top_k: int,
    renormalize: bool,
    prepared: PreparedExperts,
    expert_start: int = 0,  # the first expert ``prepared`` holds (expert parallelism)
) -> Routing:
    """``route(F.linear(hidden, router_weight), ...)`` (the logits in the model dtype, as transformers
    computes them). Unless ``QSERVE_FUSED_ROUTER_GEMM=0``, on a step that takes ``route``'s direct layout,
    the logits, the choice and the layout are one launch (``moe_router_triton.router_gemm_topk_blocks``)
    instead of the router GEMM's and the router's: one graph node fewer per MoE layer at decode. The
    same ``Routing`` either way, up to the logits' rounding (the kernel's fp32 sum runs in another order
    than cuBLAS'); host-side decisions from the shapes and the environment only: no host sync,
    CUDA-graph safe."""
    if fused_router_gemm_requested():
        block_m = _direct_block_m(prepared, hidden.shape[0], top_k, hidden.device)
        if block_m is not None:
            from quant_kernels import moe_router_triton  # noqa: PLC0415

            start, num_local = _share(prepared, router_weight.shape[0], expert_start)
            weights, ids, sorted_ids, expert_ids, num_padded, _ = moe_router_triton.router_gemm_topk_blocks(
                hidden, router_weight, top_k, renormalize, block_m, start, num_local
            )
            return Routing(weights, ids, moe_reference.BlockLayout(sorted_ids, expert_ids, num_padded, block_m))
    router_logits = F.linear(hidden, router_weight)  # [T, E], in the model dtype
    return route(router_logits, top_k, renormalize, prepared, expert_start)


def moe_experts(
    x: torch.Tensor,  # [T, H]
    prepared: PreparedExperts,
    topk_weights: torch.Tensor,  # float32 [T, k]
    topk_ids: torch.Tensor,  # int32 [T, k]
    layout: moe_reference.BlockLayout | None = None,
) -> torch.Tensor:  # [T, H]
    """``sum_j w[t, j] * expert_{ids[t, j]}(x[t])`` with the implementation ``prepared`` chose;
    pairs whose id is ``prepared.num_experts`` (another rank's expert) add nothing. ``layout``
    (``Routing.layout``): the grouped kernels' blocks for these pairs, used instead of sorting them;
    the other implementations have no blocks and ignore it."""
    if prepared.kind == "dense":
        return moe_reference.fused_moe_dense(x, prepared.gate_up, prepared.down, topk_weights, topk_ids)
    if prepared.kind == "mma":  # prepared on a device Triton serves (prepare_experts)
        from quant_kernels import moe_mma_triton  # noqa: PLC0415

        return moe_mma_triton.fused_moe_w4a16_mma(
            x, prepared.gate_up, prepared.down, topk_weights, topk_ids, skip_foreign=prepared.skip_foreign,
            layout=layout,
        )  # fmt: skip
    if prepared.kind == "stacked" and prepared.fused and kdevice.triton_serves(x.device):
        from quant_kernels import moe_triton  # noqa: PLC0415

        return moe_triton.fused_moe_w4a16(
            x, prepared.gate_up, prepared.down, topk_weights, topk_ids, skip_foreign=prepared.skip_foreign,
            layout=layout,
        )  # fmt: skip
    if prepared.kind == "stacked":
        return moe_reference.fused_moe_w4a16(x, prepared.gate_up, prepared.down, topk_weights, topk_ids)

    def mlp(expert: int, xe: torch.Tensor) -> torch.Tensor:
        gate_up = ops.w4a16_linear(xe, prepared.gate_up_list[expert])  # [c, 2I]
        return ops.w4a16_linear(elementwise_ops.silu_and_mul(gate_up), prepared.down_list[expert])

    return moe_reference.moe_loop(x, topk_weights, topk_ids, mlp, prepared.num_experts)
