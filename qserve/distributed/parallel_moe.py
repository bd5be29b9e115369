"""The tensor-parallel mixture-of-experts block: each rank computes its share of the routed
experts for every token, and one all-reduce sums the shares.

Knows: which share a rank holds (``sharding.ExpertShard``): with expert parallelism (vLLM's
``enable_expert_parallel``) whole experts, a contiguous block per rank; without it every expert,
split along its intermediate size like a dense MLP. Either way the router runs replicated, the
rank's output is a partial sum over its experts (pairs routed to another rank's experts add
nothing here), the shared expert's row-parallel down projection skips its own all-reduce
(``reduce_results=False``), and the block all-reduces routed + gated shared partials ONCE.
Must not know: checkpoint formats, which kernel runs the experts, engines.

``moe_block`` returns the plain ``SparseMoeBlock`` without a group, so a single-process model
is exactly what it was before.
"""

from __future__ import annotations

from typing import Any

import torch

from qserve.distributed.parallel_state import TPGroup
from qserve.distributed.sharding import ExpertShard, expert_shard, expert_weight_shard
from qserve.layers.moe import SparseMoeBlock
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.lora_ops import LoRAIndices


class ParallelSparseMoeBlock(SparseMoeBlock):
    """A ``SparseMoeBlock`` holding ``shard`` of the layer's routed experts on rank ``tp.rank``."""

    def __init__(self, *, shard: ExpertShard, tp: TPGroup, **kwargs: Any) -> None:
        super().__init__(
            intermediate_size=shard.intermediate_size,
            expert_start=shard.expert_start,
            num_local_experts=shard.num_local_experts,
            **kwargs,
        )
        self.shard = shard
        self.tp = tp

    def load_expert(self, expert: int, proj: str, value: torch.Tensor | PackedQuantWeight, name: str) -> None:
        """Keeps the rank's part of an expert it holds; another rank's expert is dropped (the
        loader does not even read those: ``LlamaFamilyForCausalLM.holds_weight``)."""
        if proj in self.expert_names and 0 <= expert < self.num_experts:  # else the base refuses it by name
            if not self.holds_expert(expert):
                return
            proj_index = self.expert_names.index(proj)
            value = expert_weight_shard(value, proj_index, self.shard, self.tp.rank, self.tp.size, name)
        super().load_expert(expert, proj, value, name)

    def forward(self, hidden: torch.Tensor, lora: LoRAIndices | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        partial = super().forward(hidden, lora)  # [T, H]: this rank's experts (+ its shared-expert slice)
        return self.tp.all_reduce(partial.contiguous())


def moe_block(*, tp: TPGroup | None, enable_expert_parallel: bool, **kwargs: Any) -> SparseMoeBlock:
    """A ``SparseMoeBlock`` (``tp`` None) or this rank's ``ParallelSparseMoeBlock``; ``kwargs``
    are ``SparseMoeBlock``'s, with the full ``num_experts`` and ``intermediate_size``. A shared
    expert passed in must be built tensor-parallel with ``reduce_results=False``."""
    if tp is None:
        return SparseMoeBlock(**kwargs)
    shard = expert_shard(
        kwargs["num_experts"], kwargs.pop("intermediate_size"), tp.rank, tp.size, enable_expert_parallel
    )
    return ParallelSparseMoeBlock(shard=shard, tp=tp, **kwargs)
