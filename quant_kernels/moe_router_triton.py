"""Triton router top-k for mixture-of-experts layers: softmax over the router logits, the top k
experts, their weights renormalized when the family asks, in one launch.

Knows: the contract of ``moe_reference.select_experts`` (float32 weights ``[T, k]`` in descending
order, int32 ids ``[T, k]``; softmax in float32; ``renormalize`` scales the k weights to sum to
one). Must not know: models, layers, the expert kernels that consume the ids. Imported lazily (CUDA,
or the CPU tests under TRITON_INTERPRET=1).

Why: the reference is about six launches per MoE layer (the float cast, softmax, topk, sum, divide,
the int32 cast). A decode step of one sequence replays each as a graph node of a few µs and does
almost no work in any of them; on Qwen3-30B-A3B's 48 MoE layers that is ~240 of a step's launches.

``router_topk_kernel``: program ``t`` owns token row ``t``: it loads the row's E logits (E padded to a
power of two, masked), takes the float32 softmax, then picks the k largest by k rounds of argmax
(ties go to the lower expert id), masking each pick; the picks and their weights stay in registers
(``[K_PAD]`` vectors), are renormalized if asked and stored once. The grid is ``(T,)``: no host sync,
CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def router_topk_kernel(
    logits_ptr,  # [T, E] fp16 / bf16 / fp32
    weights_ptr,  # float32 [T, k]
    ids_ptr,  # int32 [T, k]
    num_experts, stride_t,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two >= TOP_K
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    RENORMALIZE: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + t * stride_t + experts, mask=valid, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, 0)
    e = tl.where(valid, tl.exp(x), 0.0)
    probs = e / tl.sum(e, 0)  # [BLOCK_E]
    left = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks a padded or picked expert
    slots = tl.arange(0, K_PAD)
    picked_w = tl.zeros((K_PAD,), dtype=tl.float32)
    picked_id = tl.zeros((K_PAD,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        best_id = tl.min(tl.where(left == best, experts, BLOCK_E), 0)  # the lowest id among ties
        picked_w = tl.where(slots == j, best, picked_w)
        picked_id = tl.where(slots == j, best_id, picked_id)
        left = tl.where(experts == best_id, -1.0, left)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots < TOP_K, picked_w, 0.0), 0)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, picked_w, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, picked_id, mask=keep)


def router_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # float32 [T, k], int32 [T, k]
    """``moe_reference.select_experts`` in one launch (same contract; weights within float32
    rounding of the reference's, ids equal unless two probabilities tie)."""
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: must be between 1 and the {num_experts} experts")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=logits.device)  # [T, k]
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=logits.device)  # [T, k]
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    router_topk_kernel[(num_tokens,)](
        logits, weights, ids, num_experts, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block_e, RENORMALIZE=renormalize,
        num_warps=1 if block_e <= 128 else 4,
    )  # fmt: skip
    return weights, ids
