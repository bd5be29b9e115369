"""A sparse mixture-of-experts MLP block: router, routed SwiGLU experts, optional shared expert.

Knows: the block's parameters under HF names (``gate.weight`` = the router [E, H], kept in the
model dtype; ``experts.N.{gate,up,down}`` or Mixtral's ``w1/w3/w2``; Qwen2-MoE's
``shared_expert`` and ``shared_expert_gate``), how each expert's weight, as the loader streams
it one at a time, lands in ONE stacked per-layer tensor (``quant_kernels.moe_layout``; dense
experts in ``[E, 2I, H]`` / ``[E, H, I]``), and the routing math (softmax top-k, optional
renormalization, sigmoid-gated shared expert). Must not know: checkpoint formats (the loader
hands it tensors or ``PackedQuantWeight``) or which kernels run the router and the experts
(``quant_kernels.moe_ops`` decides: ``route_hidden`` from the block's input and router weight,
``moe_experts``), nor process groups.

The block may hold a contiguous part ``[expert_start, +num_local_experts)`` of the experts
(expert parallelism, ``qserve.distributed.parallel_moe``): the router still scores all
``num_experts``, and pairs routed elsewhere contribute nothing here. By default it holds all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quant_kernels import moe_ops
from quant_kernels.layout import PackedQuantWeight
from quant_kernels.lora_ops import LoRAIndices
from quant_kernels.moe_layout import StackedQuantWeight


class _Weight(nn.Module):
    """A module holding one plain ``weight`` parameter (the router, the shared expert's gate)."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype), requires_grad=False)


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        *,
        prefix: str,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        expert_names: tuple[str, str, str],
        quantized: bool,
        dtype: torch.dtype,
        shared_expert: nn.Module | None = None,
        expert_start: int = 0,
        num_local_experts: int | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.hidden_size = hidden_size
        self.num_experts = num_experts  # the router's: every expert of the layer
        self.expert_start = expert_start
        self.num_local_experts = num_experts if num_local_experts is None else num_local_experts  # stored here
        if not (0 <= expert_start and expert_start + self.num_local_experts <= num_experts):
            raise ValueError(
                f"{prefix}: experts [{expert_start}, +{self.num_local_experts}) outside [0, {num_experts})"
            )
        self.top_k = top_k
        self.intermediate_size = intermediate_size  # of each stored expert
        self.renormalize = renormalize
        self.quantized = quantized
        self.expert_names = expert_names
        self.gate = _Weight(num_experts, hidden_size, dtype)  # the router: never quantized
        self.shared_expert = shared_expert
        self.shared_expert_gate = _Weight(1, hidden_size, dtype) if shared_expert is not None else None
        # Stacked storage, filled expert by expert. Dense: allocated now (plain tensors, not
        # parameters: the loader routes expert tensors here by name, see load_expert).
        if quantized:
            self.w_gate_up: torch.Tensor | StackedQuantWeight | None = None  # allocated at the first expert
            self.w_down: torch.Tensor | StackedQuantWeight | None = None
        else:
            local = self.num_local_experts
            self.w_gate_up = torch.empty(local, 2 * intermediate_size, hidden_size, dtype=dtype)  # [E_local, 2I, H]
            self.w_down = torch.empty(local, hidden_size, intermediate_size, dtype=dtype)  # [E_local, H, I]
        self._loaded: set[tuple[int, int]] = set()
        self.prepared: moe_ops.PreparedExperts | None = None

    # ------------------------------------------------------------------------------------------
    # Loading
    # ------------------------------------------------------------------------------------------

    def holds_expert(self, expert: int) -> bool:
        """Whether expert ``expert`` (a layer-wide index) is stored in this block."""
        return self.expert_start <= expert < self.expert_start + self.num_local_experts

    def load_expert(self, expert: int, proj: str, value: torch.Tensor | PackedQuantWeight, name: str) -> None:
        """One expert's gate / up / down weight (``proj`` is its checkpoint name; ``expert`` the
        layer-wide index)."""
        if proj not in self.expert_names:
            raise ValueError(f"{name}: unknown expert projection {proj!r}; expected one of {self.expert_names}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"{name}: expert {expert} out of range for num_experts={self.num_experts}")
        if not self.holds_expert(expert):
            raise ValueError(f"{name}: expert {expert} is not among the experts this block holds")
        slot = expert - self.expert_start  # its index in the stacked storage
        shard = self.expert_names.index(proj)  # 0 gate, 1 up, 2 down
        inter, hidden = self.intermediate_size, self.hidden_size
        k, n = (inter, hidden) if shard == 2 else (hidden, inter)
        if isinstance(value, PackedQuantWeight) != self.quantized:
            kind = "a quantized" if isinstance(value, PackedQuantWeight) else "an unquantized"
            raise ValueError(f"{name}: {kind} expert weight in a layer whose other experts are not")
        if isinstance(value, PackedQuantWeight):
            if (value.in_features, value.out_features) != (k, n):
                raise ValueError(
                    f"{name}: packed expert weight has K={value.in_features}, N={value.out_features}, expected K={k}, N={n}"
                )
            if shard == 2:
                if self.w_down is None:
                    self.w_down = StackedQuantWeight.empty_like_expert(value, self.num_local_experts, hidden)
                self.w_down.store(slot, value, name)
            else:
                if self.w_gate_up is None:
                    self.w_gate_up = StackedQuantWeight.empty_like_expert(value, self.num_local_experts, 2 * inter)
                self.w_gate_up.store(slot, value, name, col_start=shard * inter)
        else:
            if tuple(value.shape) != (n, k):
                raise ValueError(f"{name}: expert weight shape {tuple(value.shape)}, expected {(n, k)}")
            if shard == 2:
                self.w_down[slot].copy_(value)
            else:
                self.w_gate_up[slot, shard * inter : (shard + 1) * inter].copy_(value)
        self._loaded.add((expert, shard))

    def missing(self) -> list[str]:
        held = range(self.expert_start, self.expert_start + self.num_local_experts)
        return [
            f"{self.prefix}.experts.{e}.{self.expert_names[s]}"
            for e in held
            for s in range(3)
            if (e, s) not in self._loaded
        ]

    @property
    def holds_all_experts(self) -> bool:
        return self.num_local_experts == self.num_experts

    def process_after_loading(self) -> None:
        self.prepared = moe_ops.prepare_experts(self.w_gate_up, self.w_down, skip_foreign=not self.holds_all_experts)
        if self.prepared.kind in ("per_expert", "mma"):  # the kernels' copies replace the canonical stack
            self.w_gate_up = self.w_down = None

    @property
    def graph_safe(self) -> bool:
        return self.prepared is None or self.prepared.graph_safe

    def expert_nbytes(self) -> int:
        return 0 if self.prepared is None else self.prepared.nbytes()

    # ------------------------------------------------------------------------------------------
    # Forward
    # ------------------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, lora: LoRAIndices | None = None) -> torch.Tensor:  # [T, H] -> [T, H]
        """``lora``: the step's adapter rows, taken as every MLP takes them; routed and shared experts
        hold no LoRA slots (``qserve.lora.slots.lora_targets``), so the block's output is the base one."""
        if self.prepared is None:
            raise RuntimeError(f"{self.prefix}: experts used before process_after_loading")
        # The router's logits ([T, E], F.linear in the model dtype as in transformers) and its choice: ids
        # into this block's stack (another block's experts -> the sentinel), plus whatever the dispatch
        # hands from the router to the experts (Routing.layout); moe_ops may fuse the logits' GEMM into
        # the router's launch (QSERVE_FUSED_ROUTER_GEMM)
        routing = moe_ops.route_hidden(
            hidden, self.gate.weight, self.top_k, self.renormalize, self.prepared, self.expert_start
        )
        out = moe_ops.moe_experts(hidden, self.prepared, routing.weights, routing.ids, routing.layout)  # [T, H]
        if self.shared_expert is not None:
            shared_gate = torch.sigmoid(F.linear(hidden, self.shared_expert_gate.weight))  # [T, 1]
            out = out + shared_gate * self.shared_expert(hidden)
        return out
