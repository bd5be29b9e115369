"""The fused MoE W4A16 kernel against its PyTorch reference (interpreter on CPU, real sizes on GPU),
and the token sort both share."""

from __future__ import annotations

import pytest
import torch

from quant_kernels import moe_reference
from quant_kernels.layout import pack_codes
from quant_kernels.moe_layout import StackedQuantWeight

triton = pytest.importorskip("triton")


def random_stacked(
    num_experts: int, k: int, n: int, group_size: int, sym: bool, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> StackedQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    codes = torch.randint(0, 16, (num_experts, k, n), generator=gen)
    qweight = torch.stack([pack_codes(codes[e], 4) for e in range(num_experts)])  # [E, K/8, N]
    scales = (torch.rand(num_experts, groups, n, generator=gen) * 0.02 + 0.005).to(dtype)  # [E, ng, N]
    zeros = None if sym else torch.randint(0, 16, (num_experts, groups, n), generator=gen).to(torch.uint8)
    return StackedQuantWeight(
        4, group_size, qweight.to(device), scales.to(device), None if zeros is None else zeros.to(device)
    )


def routing(num_tokens: int, num_experts: int, top_k: int, hidden: int, dtype, seed: int, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(device)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    logits[:, num_experts // 2 :] -= 100.0  # half of the experts are hit by no token
    weights, ids = moe_reference.select_experts(logits, top_k, renormalize=True)
    return x, weights.to(device), ids.to(device)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size(num_tokens, block_m):
    num_experts, top_k = 8, 2
    _, _, ids = routing(num_tokens, num_experts, top_k, 8, torch.float32, seed=num_tokens)
    sorted_ids, expert_ids, num_padded = moe_reference.moe_align_block_size(ids, num_experts, block_m)
    flat = ids.reshape(-1).long()
    used = int(num_padded)
    assert used % block_m == 0 and sorted_ids.shape[0] % block_m == 0 and used <= sorted_ids.shape[0]
    assert bool((sorted_ids[used:] == flat.numel()).all())
    real = sorted_ids[:used]
    assert sorted(real[real < flat.numel()].tolist()) == list(range(flat.numel()))  # every pair once
    for block in range(used // block_m):
        rows = real[block * block_m : (block + 1) * block_m]
        rows = rows[rows < flat.numel()].long()
        assert rows.numel() > 0  # padding never fills a whole block
        assert bool((flat[rows] == expert_ids[block]).all())


@pytest.mark.parametrize(
    ("group_size", "num_tokens", "sym"),
    [(32, 1, True), (32, 64, False), (64, 3, False), (64, 17, True), (128, 1, False), (128, 40, True)],
)
def test_fused_moe_matches_reference(group_size, num_tokens, sym):
    from quant_kernels import moe_triton

    num_experts, top_k, hidden, inter = 8, 2, 128, 64
    dtype = torch.float16
    seed = group_size + num_tokens + sym
    w13 = random_stacked(num_experts, hidden, 2 * inter, group_size, sym, dtype, seed=seed)
    w2 = random_stacked(num_experts, inter, hidden, min(group_size, inter), sym, dtype, seed=seed + 1)
    x, weights, ids = routing(num_tokens, num_experts, top_k, hidden, dtype, seed)
    expected = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    config = moe_triton.MoEConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    out = moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, config=config)
    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_fused_moe_poisoned_outputs(monkeypatch):
    """Padding rows are never written: intermediate and output buffers start as NaN."""
    from quant_kernels import moe_triton

    real_empty = torch.empty
    monkeypatch.setattr(
        moe_triton.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")), raising=True
    )
    w13 = random_stacked(4, 64, 64, 32, True, torch.float16, seed=3)
    w2 = random_stacked(4, 32, 64, 32, True, torch.float16, seed=4)
    x, weights, ids = routing(6, 4, 2, 64, torch.float16, seed=5)
    out = moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, moe_triton.MoEConfig(16, 32, 4, 1))
    expected = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def _as_f32(w: StackedQuantWeight) -> StackedQuantWeight:
    return StackedQuantWeight(w.bits, w.group_size, w.qweight, w.scales.float(), w.zeros, w.perm)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 128, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_moe_qwen3_30b_shapes_on_gpu(num_tokens, dtype):
    """Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts top-8, expert MLP 768, g128)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_triton

    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = random_stacked(num_experts, hidden, 2 * inter, 128, True, dtype, device="cuda", seed=1)
    w2 = random_stacked(num_experts, inter, hidden, 128, True, dtype, device="cuda", seed=2)
    x, weights, ids = routing(num_tokens, num_experts, top_k, hidden, dtype, seed=num_tokens, device="cuda")
    expected = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    out = moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids)
    if dtype == torch.float16:
        torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)
    else:
        # bf16 keeps 8 mantissa bits: the dequantized weights (MMA operands), the SiLU-and-mul
        # intermediate and each pair's row are rounded to it, so ~1.5% of outputs (|y| up to ~40)
        # land 0.03-0.17 off the fp32 reference (seen on the H200). Emulating those roundings on the
        # CPU gives a relative norm error of 0.0037; a lost expert or a wrong scale gives > 0.1.
        error = out.float() - expected
        assert float(error.norm() / expected.norm()) < 1.5e-2
        assert float(error.abs().max()) < 2e-2 * float(expected.abs().max())


def test_per_expert_loop_matches_reference():
    """The default GPU path's code (a loop of ``ops.w4a16_linear`` over the hit experts and the
    measured silu_and_mul), run with CPU-prepared weights, equals the reference."""
    from quant_kernels import moe_ops, ops

    w13 = random_stacked(8, 64, 64, 32, False, torch.float32, seed=7)
    w2 = random_stacked(8, 32, 64, 32, False, torch.float32, seed=8)
    x, weights, ids = routing(9, 8, 2, 64, torch.float32, seed=9)
    prepared = moe_ops.PreparedExperts(
        "per_expert",
        8,
        32,
        gate_up_list=[ops.prepare_w4a16(w13.expert(e)) for e in range(8)],
        down_list=[ops.prepare_w4a16(w2.expert(e)) for e in range(8)],
    )
    assert not prepared.graph_safe
    expected = moe_reference.fused_moe_w4a16(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe_ops.moe_experts(x, prepared, weights, ids), expected, atol=1e-5, rtol=1e-5)
    on_cpu = moe_ops.prepare_experts(w13, w2)  # off CUDA: the reference, whatever QSERVE_FUSED_MOE says
    assert (on_cpu.kind, on_cpu.fused) == ("stacked", False)
