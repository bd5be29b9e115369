"""The router top-k kernel (``moe_router_triton``) against ``moe_reference.select_experts``
(interpreter on CPU, Qwen3-30B-A3B / Mixtral / Qwen2-MoE router shapes on GPU), and its dispatch."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from quant_kernels import moe_reference

triton = pytest.importorskip("triton")


def router_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """Distinct logits per row (a random permutation of a spread), so no two probabilities tie and
    the top-k ids are defined; scaled as a trained router's are (a few units)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
    logits = torch.stack(rows).float() * (8.0 / num_experts) - 4.0  # [T, E], steps of 8/E
    return logits.to(dtype).to(device)


def assert_same_choice(got, want) -> None:
    (w_got, id_got), (w_want, id_want) = got, want
    assert w_got.dtype == torch.float32 and id_got.dtype == torch.int32
    assert w_got.shape == w_want.shape and id_got.shape == id_want.shape
    assert torch.equal(id_got.cpu(), id_want.cpu())
    torch.testing.assert_close(w_got.cpu(), w_want.cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "renormalize", "dtype"),
    [
        (1, 8, 2, True, torch.float16),  # Mixtral
        (3, 60, 4, False, torch.bfloat16),  # Qwen2-MoE: E not a power of two, no renormalization
        (5, 128, 8, True, torch.bfloat16),  # Qwen3-MoE
        (5, 128, 8, False, torch.float16),
        (2, 64, 1, True, torch.float32),  # k = 1: the one weight renormalizes to 1
        (4, 160, 6, False, torch.float32),
    ],
)
def test_router_topk_matches_reference(num_tokens, num_experts, top_k, renormalize, dtype):
    from quant_kernels import moe_router_triton

    logits = router_logits(num_tokens, num_experts, dtype, seed=num_tokens * 1000 + num_experts)
    want = moe_reference.select_experts(logits, top_k, renormalize)
    assert_same_choice(moe_router_triton.router_topk(logits, top_k, renormalize), want)


def test_router_topk_reads_a_strided_view_and_breaks_ties_to_the_lower_id():
    """A column slice (row stride past E) reads right; equal logits pick the lower expert id first;
    an out-of-range k is refused by name."""
    from quant_kernels import moe_router_triton

    wide = router_logits(3, 40, torch.float32, seed=9)
    view = wide[:, :32]  # [3, 32], stride 40
    assert_same_choice(moe_router_triton.router_topk(view, 4, True), moe_reference.select_experts(view, 4, True))
    tied = torch.zeros((1, 16))
    tied[0, [3, 7, 11]] = 2.0
    weights, ids = moe_router_triton.router_topk(tied, 2, False)
    assert ids.tolist() == [[3, 7]]
    with pytest.raises(ValueError, match="top_k=9"):
        moe_router_triton.router_topk(torch.zeros((1, 8)), 9, True)


def test_dispatch_takes_the_kernel_only_when_asked(monkeypatch):
    """``moe_ops.select_experts``: the reference unless ``QSERVE_FUSED_ROUTER=1`` on a device Triton
    serves (the CPU stands in; the interpreter runs the kernel)."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_ops, moe_router_triton

    logits = router_logits(2, 16, torch.float16, seed=3)
    calls = []
    real = moe_router_triton.router_topk
    monkeypatch.setattr(moe_router_triton, "router_topk", lambda *a: calls.append(a) or real(*a))
    with mock.patch.object(kdevice, "triton_serves", lambda device: True):
        monkeypatch.delenv(moe_ops.FUSED_ROUTER_ENV, raising=False)
        plain = moe_ops.select_experts(logits, 2, True)
        assert not calls
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "1")
        fused = moe_ops.select_experts(logits, 2, True)
        assert len(calls) == 1
    assert_same_choice(fused, plain)
    monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "1")  # off a Triton device: the reference
    moe_ops.select_experts(logits, 2, True)
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 128, 4096])
@pytest.mark.parametrize(("num_experts", "top_k", "renormalize"), [(128, 8, True), (8, 2, True), (60, 4, False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_router_topk_on_gpu(num_tokens, num_experts, top_k, renormalize, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_router_triton

    logits = router_logits(num_tokens, num_experts, dtype, seed=num_tokens, device="cuda")
    want = moe_reference.select_experts(logits, top_k, renormalize)
    assert_same_choice(moe_router_triton.router_topk(logits, top_k, renormalize), want)
