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


def _poison_empty(monkeypatch, module) -> None:
    """``module``'s ``torch.empty`` returns NaN (floats) or -7 (integers): an element a kernel
    should write and does not shows."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    monkeypatch.setattr(module.torch, "empty", poisoned, raising=True)


def _align_case(num_tokens: int, top_k: int, num_experts: int, routing_kind: str, seed: int) -> torch.Tensor:
    """int32 [T, k] expert ids: ``spread`` (uniform, most experts hit), ``half`` (experts of the upper
    half never hit), ``one`` (expert 1 takes every pair), ``foreign`` (a third of the pairs on the
    sentinel ``num_experts``, as ``local_expert_ids`` marks other ranks' experts)."""
    gen = torch.Generator().manual_seed(seed)
    if routing_kind == "one":
        return torch.ones((num_tokens, top_k), dtype=torch.int32)
    high = max(num_experts // 2, 1) if routing_kind == "half" else num_experts
    ids = torch.randint(0, high, (num_tokens, top_k), generator=gen, dtype=torch.int32)
    if routing_kind == "foreign":
        ids[torch.rand(num_tokens, top_k, generator=gen) < 1 / 3] = num_experts
    return ids


ALIGN_CASES = [  # (T, k, E, block_m, routing, skip_foreign)
    (0, 8, 16, 16, "spread", False),  # no pairs: num_padded 0, empty outputs
    (1, 8, 128, 16, "spread", False),  # Qwen3-30B-A3B decode: T*k far below E
    (1, 2, 8, 16, "spread", False),
    (3, 2, 64, 32, "half", False),
    (7, 4, 8, 64, "one", False),  # one expert takes every pair
    (64, 2, 8, 16, "half", False),  # empty experts, full groups
    (33, 3, 16, 32, "spread", False),
    (17, 8, 128, 64, "half", False),
    (9, 2, 4, 16, "foreign", True),  # the sentinel group sorts past num_padded
    (40, 4, 32, 32, "foreign", True),
    (5, 8, 8, 64, "foreign", True),
    (6, 2, 4, 16, "one", True),  # skip_foreign without a foreign pair
]


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m", "routing_kind", "skip_foreign"), ALIGN_CASES)
@pytest.mark.parametrize("chunk", [16, 1024])
def test_triton_align_equals_reference(monkeypatch, num_tokens, top_k, num_experts, block_m, routing_kind, skip_foreign,
                                       chunk):  # fmt: skip
    """The one-launch token sort returns exactly the reference's three tensors, padding and sentinel
    group included (pair order kept within each expert); its outputs start poisoned. ``chunk`` 16
    runs the pair loops over several chunks (cursors carried from one chunk to the next)."""
    from quant_kernels import moe_triton

    _poison_empty(monkeypatch, moe_triton)
    monkeypatch.setattr(moe_triton, "ALIGN_CHUNK", chunk)
    ids = _align_case(num_tokens, top_k, num_experts, routing_kind, seed=num_tokens * top_k + block_m)
    want = moe_reference.moe_align_block_size(ids, num_experts, block_m, skip_foreign)
    got = moe_triton.moe_align_block_size(ids, num_experts, block_m, skip_foreign)
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_padded"), got, want):
        assert g.dtype == torch.int32 and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


def test_triton_align_over_many_chunks_at_the_real_chunk():
    """More pairs than one chunk of the real chunk size (1120 > 1024): a prefill of 140 tokens (the
    interpreter's time grows with the pairs: 300 tokens took 7.5 s of CI, twice)."""
    from quant_kernels import moe_triton

    ids = _align_case(140, 8, 128, "foreign", seed=1)
    assert ids.numel() > moe_triton.ALIGN_CHUNK
    for block_m, skip_foreign in ((64, True), (16, False)):
        if not skip_foreign:
            ids = ids.clamp(max=127)
        want = moe_reference.moe_align_block_size(ids, 128, block_m, skip_foreign)
        got = moe_triton.moe_align_block_size(ids, 128, block_m, skip_foreign)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_long_prefills_sort_with_the_reference(monkeypatch):
    """Past ``QSERVE_MOE_ALIGN_MAX_PAIRS`` pairs (default 16384) the launcher runs the reference's torch
    ops (one program lost to them at 4,096 tokens on the H200) and launches no kernel; at the limit,
    and under the default, it launches the kernel; a bad value is refused by name."""
    from quant_kernels import moe_triton

    ids = _align_case(40, 8, 16, "spread", seed=5)  # 320 pairs
    monkeypatch.setenv(moe_triton.ALIGN_MAX_PAIRS_ENV, str(ids.numel() - 1))
    monkeypatch.setattr(moe_triton, "moe_align_block_size_kernel", None)  # a launch would raise
    want = moe_reference.moe_align_block_size(ids, 16, 16)
    for g, w in zip(moe_triton.moe_align_block_size(ids, 16, 16), want):
        assert g.dtype == torch.int32 and torch.equal(g, w)
    assert moe_triton.align_max_pairs() == ids.numel() - 1
    for limit in (str(ids.numel()), ""):
        monkeypatch.setenv(moe_triton.ALIGN_MAX_PAIRS_ENV, limit)
        with pytest.raises(TypeError):
            moe_triton.moe_align_block_size(ids, 16, 16)
    monkeypatch.delenv(moe_triton.ALIGN_MAX_PAIRS_ENV)  # the default: a 2,049-token prefill x top-8 sorts in torch
    long_ids = torch.randint(0, 16, (moe_triton.ALIGN_MAX_PAIRS_DEFAULT // 8 + 1, 8), dtype=torch.int32)
    for g, w in zip(
        moe_triton.moe_align_block_size(long_ids, 16, 16), moe_reference.moe_align_block_size(long_ids, 16, 16)
    ):
        assert torch.equal(g, w)
    monkeypatch.setenv(moe_triton.ALIGN_MAX_PAIRS_ENV, "16k")
    with pytest.raises(ValueError, match="QSERVE_MOE_ALIGN_MAX_PAIRS='16k'"):
        moe_triton.moe_align_block_size(ids, 16, 16)


def test_fused_moe_uses_the_triton_align(monkeypatch):
    """The fused layer sorts with the Triton kernel, and its output is bit for bit the one it gives
    with the reference's sort (each block's rows are computed independently of the sort's op)."""
    from quant_kernels import moe_triton

    w13 = random_stacked(8, 64, 64, 32, False, torch.float16, seed=61)
    w2 = random_stacked(8, 32, 64, 32, False, torch.float16, seed=62)
    x, weights, ids = routing(10, 8, 2, 64, torch.float16, seed=63)
    config = moe_triton.MoEConfig(16, 32, 4, 1)
    calls = []
    triton_align = moe_triton.moe_align_block_size
    monkeypatch.setattr(moe_triton, "moe_align_block_size", lambda *a: calls.append(a) or triton_align(*a))
    out = moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, config)
    assert len(calls) == 1 and calls[0][1:] == (8, 16, False)
    monkeypatch.setattr(moe_triton, "moe_align_block_size", moe_reference.moe_align_block_size)
    assert torch.equal(out, moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, config))


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

    _poison_empty(monkeypatch, moe_triton)
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


# ----------------------------------------------------------------------------------------------
# Expert parallelism: a rank's share of the experts, other ranks' pairs as the sentinel id
# ----------------------------------------------------------------------------------------------


def _rank_share(w: StackedQuantWeight, rank: int, num_ranks: int) -> StackedQuantWeight:
    n = w.num_experts // num_ranks
    held = slice(rank * n, (rank + 1) * n)
    return StackedQuantWeight(
        w.bits, w.group_size, w.qweight[held], w.scales[held], None if w.zeros is None else w.zeros[held]
    )


def test_local_expert_ids_mark_other_ranks_experts() -> None:
    ids = torch.tensor([[0, 5], [7, 2], [4, 3]], dtype=torch.int32)
    assert moe_reference.local_expert_ids(ids, 4, 4).tolist() == [[4, 1], [3, 4], [0, 4]]
    assert moe_reference.local_expert_ids(ids, 0, 4).tolist() == [[0, 4], [4, 2], [4, 3]]


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_block_size_skips_foreign_pairs(block_m):
    _, _, ids = routing(13, 8, 2, 8, torch.float32, seed=block_m)
    ids[:, :] = torch.tensor([[1, 6], [5, 0]]).repeat(7, 1)[:13]  # half of the pairs on experts 4..7
    local = moe_reference.local_expert_ids(ids, 0, 4)  # rank 0 of 2: experts 0..3
    sorted_ids, expert_ids, num_padded = moe_reference.moe_align_block_size(local, 4, block_m, skip_foreign=True)
    flat = local.reshape(-1).long()
    used = int(num_padded)
    real = sorted_ids[:used]
    real = real[real < flat.numel()].long()
    assert sorted(real.tolist()) == sorted((flat < 4).nonzero().flatten().tolist())  # own pairs once, no other
    for block in range(used // block_m):
        rows = sorted_ids[block * block_m : (block + 1) * block_m]
        rows = rows[rows < flat.numel()].long()
        assert bool((flat[rows] == expert_ids[block]).all())


def test_rank_shares_sum_to_the_whole_layer():
    """Each rank's experts over its local ids (reference path); the shares add up to all experts."""
    w13 = random_stacked(8, 64, 64, 32, False, torch.float32, seed=21)
    w2 = random_stacked(8, 32, 64, 32, False, torch.float32, seed=22)
    x, weights, ids = routing(11, 8, 2, 64, torch.float32, seed=23)
    ids = torch.randint(0, 8, ids.shape, generator=torch.Generator().manual_seed(24), dtype=torch.int32)
    want = moe_reference.fused_moe_w4a16(x, w13, w2, weights, ids)
    shares = []
    for rank in range(2):
        local = moe_reference.local_expert_ids(ids, 4 * rank, 4)
        shares.append(
            moe_reference.fused_moe_w4a16(x, _rank_share(w13, rank, 2), _rank_share(w2, rank, 2), weights, local)
        )
    assert not torch.allclose(shares[0], want) and not torch.allclose(shares[1], want)
    torch.testing.assert_close(shares[0] + shares[1], want, atol=1e-5, rtol=1e-5)


def test_fused_moe_skips_foreign_pairs(monkeypatch):
    """The Triton kernel (interpreter) over one rank's experts with the sentinel ids equals the
    reference; its buffers start as NaN, so a skipped pair's row must be written as zero."""
    from quant_kernels import moe_triton

    _poison_empty(monkeypatch, moe_triton)
    w13 = random_stacked(8, 64, 64, 32, True, torch.float16, seed=31)
    w2 = random_stacked(8, 32, 64, 32, True, torch.float16, seed=32)
    x, weights, ids = routing(7, 8, 2, 64, torch.float16, seed=33)
    ids = torch.randint(0, 8, ids.shape, generator=torch.Generator().manual_seed(34), dtype=torch.int32)
    local = moe_reference.local_expert_ids(ids, 4, 4)  # rank 1 of 2
    assert bool((local == 4).any()) and bool((local < 4).any())
    mine13, mine2 = _rank_share(w13, 1, 2), _rank_share(w2, 1, 2)
    config = moe_triton.MoEConfig(16, 32, 4, 1)
    out = moe_triton.fused_moe_w4a16(x, mine13, mine2, weights, local, config, skip_foreign=True)
    expected = moe_reference.fused_moe_w4a16(x.float(), _as_f32(mine13), _as_f32(mine2), weights, local)
    assert not bool(out.isnan().any())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_per_expert_loop_skips_foreign_pairs():
    from quant_kernels import moe_ops, ops

    w13 = random_stacked(4, 64, 64, 32, False, torch.float32, seed=41)
    w2 = random_stacked(4, 32, 64, 32, False, torch.float32, seed=42)
    x, weights, _ = routing(9, 8, 2, 64, torch.float32, seed=43)
    ids = torch.randint(0, 8, weights.shape, generator=torch.Generator().manual_seed(44), dtype=torch.int32)
    local = moe_reference.local_expert_ids(ids, 0, 4)
    prepared = moe_ops.PreparedExperts(
        "per_expert",
        4,
        32,
        gate_up_list=[ops.prepare_w4a16(w13.expert(e)) for e in range(4)],
        down_list=[ops.prepare_w4a16(w2.expert(e)) for e in range(4)],
        skip_foreign=True,
    )
    expected = moe_reference.fused_moe_w4a16(x, w13, w2, weights, local)
    torch.testing.assert_close(moe_ops.moe_experts(x, prepared, weights, local), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 32, 256])
def test_fused_moe_skips_foreign_pairs_on_gpu(num_tokens):
    """Qwen3-30B-A3B's expert shapes, one rank of 4 (32 experts held), real kernel."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_triton

    dtype = torch.float16
    w13 = random_stacked(32, 2048, 2 * 768, 128, True, dtype, device="cuda", seed=51)
    w2 = random_stacked(32, 768, 2048, 128, True, dtype, device="cuda", seed=52)
    x, weights, ids = routing(num_tokens, 128, 8, 2048, dtype, seed=num_tokens, device="cuda")
    local = moe_reference.local_expert_ids(ids, 32, 32)
    expected = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, local)
    out = moe_triton.fused_moe_w4a16(x, w13, w2, weights, local, skip_foreign=True)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


# ----------------------------------------------------------------------------------------------
# The sort-free layout (one pair per block, QSERVE_MOE_DIRECT_BLOCKS): its contract, and the grouped
# kernels' output with it equal, bit for bit, to theirs with the sort (each row of a block is
# computed on its own, and the blocks have the same block_m: the same tile shapes)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m", "skip_foreign"), [
    (1, 2, 8, 16, False), (3, 4, 12, 4, False), (4, 8, 16, 16, True), (3, 3, 6, 4, True),
])  # fmt: skip
def test_direct_block_layout_contract(num_tokens, top_k, num_experts, block_m, skip_foreign):
    """One local pair per block, in pair order, first row; the rest of every block the sentinel;
    ``num_padded`` ends after the local pairs' blocks (foreign pairs are never computed)."""
    gen = torch.Generator().manual_seed(num_tokens * 100 + top_k)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
    if skip_foreign:
        ids = moe_reference.local_expert_ids(ids, num_experts // 2, num_experts // 2)
        num_experts //= 2
        assert bool((ids == num_experts).any()) and bool((ids < num_experts).any())
    sorted_ids, expert_ids, num_padded = moe_reference.direct_block_layout(ids, num_experts, block_m, skip_foreign)
    num_pairs = ids.numel()
    flat = ids.reshape(-1)
    mine = (flat < num_experts).nonzero().flatten()  # [local pairs], in pair order
    assert sorted_ids.shape == (num_pairs * block_m,) and expert_ids.shape == (num_pairs,)
    assert sorted_ids.dtype == expert_ids.dtype == num_padded.dtype == torch.int32
    assert int(num_padded) == mine.numel() * block_m
    blocks = sorted_ids.view(num_pairs, block_m)
    assert bool((blocks[:, 1:] == num_pairs).all())
    assert blocks[: mine.numel(), 0].tolist() == mine.tolist()
    assert bool((blocks[mine.numel() :, 0] == num_pairs).all())
    assert expert_ids[: mine.numel()].tolist() == flat[mine].tolist()
    assert bool((expert_ids < num_experts).all())  # every block's expert indexes the stack, computed or not


# (tokens, experts, top_k, group, sym, dtype, expert-parallel ranks: 1 = all experts held)
DIRECT_CASES = [
    (1, 8, 2, 64, True, torch.float16, 1),
    (2, 16, 8, 32, False, torch.bfloat16, 1),
    (3, 12, 4, 64, False, torch.float16, 1),
    (4, 16, 8, 64, True, torch.bfloat16, 1),
    (3, 16, 4, 64, False, torch.bfloat16, 2),  # rank 1 of 2: sentinel ids, blocks past num_padded
    (4, 8, 2, 32, True, torch.float16, 2),
]


def _direct_case(case):
    num_tokens, num_experts, top_k, group, sym, dtype, ranks = case
    seed = num_tokens * 10 + top_k
    w13 = random_stacked(num_experts, 128, 2 * 64, group, sym, dtype, seed=seed)
    w2 = random_stacked(num_experts, 64, 128, group, sym, dtype, seed=seed + 1)
    x, weights, _ = routing(num_tokens, num_experts, top_k, 128, dtype, seed=seed + 2)
    gen = torch.Generator().manual_seed(seed + 3)  # k distinct experts per token, spread over every rank's
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).int()
    if ranks > 1:  # the last rank's share, the others' pairs as the sentinel
        held = num_experts // ranks
        ids = moe_reference.local_expert_ids(ids, num_experts - held, held)
        w13, w2 = _rank_share(w13, ranks - 1, ranks), _rank_share(w2, ranks - 1, ranks)
        assert bool((ids == held).any()) and bool((ids < held).any())
    return x, w13, w2, weights, ids, ranks > 1


def _layout(ids: torch.Tensor, num_experts: int, block_m: int, skip_foreign: bool) -> moe_reference.BlockLayout:
    return moe_reference.BlockLayout(
        *moe_reference.direct_block_layout(ids, num_experts, block_m, skip_foreign), block_m
    )


def _no_sort(monkeypatch, module) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the token sort ran although a block layout was given")

    monkeypatch.setattr(module, "moe_align_block_size", refuse)


@pytest.mark.parametrize("case", DIRECT_CASES, ids=[
    f"T{c[0]}-E{c[1]}-k{c[2]}-g{c[3]}-{'sym' if c[4] else 'asym'}-{str(c[5])[6:]}-ranks{c[6]}" for c in DIRECT_CASES
])  # fmt: skip
def test_mma_kernel_direct_layout_equals_sorted(monkeypatch, case):
    from quant_kernels import moe_mma_triton, moe_triton

    x, w13, w2, weights, ids, skip_foreign = _direct_case(case)
    m13, m2 = moe_mma_triton.prepare_stacked(w13), moe_mma_triton.prepare_stacked(w2)
    sorted_out = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, skip_foreign=skip_foreign)
    block_m = moe_mma_triton.default_config(*ids.shape, w13.num_experts).block_m
    layout = _layout(ids, w13.num_experts, block_m, skip_foreign)
    _no_sort(monkeypatch, moe_triton)
    direct = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, skip_foreign=skip_foreign, layout=layout)
    assert torch.isfinite(direct).all()
    assert torch.equal(direct, sorted_out)


@pytest.mark.parametrize("case", [DIRECT_CASES[1], DIRECT_CASES[4]], ids=["all-experts", "rank-of-2"])
def test_split_k_takes_the_direct_layout(monkeypatch, case):
    """Split-K (``QSERVE_MOE_SPLIT_K``) with the router's layout: no sort, the sorted path's result
    (to fp32 summation order: the blocks, hence the down launch's atomic adds, come in another order)."""
    import dataclasses

    from quant_kernels import moe_mma_triton, moe_triton

    x, w13, w2, weights, ids, skip_foreign = _direct_case(case)
    m13, m2 = moe_mma_triton.prepare_stacked(w13), moe_mma_triton.prepare_stacked(w2)
    config = dataclasses.replace(moe_mma_triton.default_config(*ids.shape, w13.num_experts), split_k=2)
    sorted_out = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, config, skip_foreign)
    layout = _layout(ids, w13.num_experts, config.block_m, skip_foreign)
    _no_sort(monkeypatch, moe_triton)
    direct = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, config, skip_foreign, layout)
    torch.testing.assert_close(direct, sorted_out, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("case", [DIRECT_CASES[1], DIRECT_CASES[4]], ids=["all-experts", "rank-of-2"])
def test_fused_kernel_direct_layout_equals_sorted(monkeypatch, case):
    from quant_kernels import moe_triton

    x, w13, w2, weights, ids, skip_foreign = _direct_case(case)
    sorted_out = moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, skip_foreign=skip_foreign)
    block_m = moe_triton.default_config(*ids.shape, w13.num_experts).block_m
    layout = _layout(ids, w13.num_experts, block_m, skip_foreign)
    _no_sort(monkeypatch, moe_triton)
    direct = moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, skip_foreign=skip_foreign, layout=layout)
    assert torch.equal(direct, sorted_out)
    with pytest.raises(ValueError, match="block_m=4"):  # a layout for another tiling is refused
        moe_triton.fused_moe_w4a16(x, w13, w2, weights, ids, skip_foreign=skip_foreign,
                                   layout=_layout(ids, w13.num_experts, 4, skip_foreign))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4])
@pytest.mark.parametrize("ep", [False, True], ids=["all-experts", "rank-1-of-4"])
def test_direct_layout_equals_sorted_on_gpu(monkeypatch, num_tokens, ep):
    """Qwen3-30B-A3B's experts through the MMA kernel: without split-K the router's one-pair-per-block
    layout gives the sorted path's output bit for bit (each block row is its own MMA column); with the
    default split (``QSERVE_MOE_SPLIT_K=auto``, which splits at one and two tokens here) the same to
    fp32 summation order (the down launch's atomic adds come in block order, which the layouts
    differ in: the H100's first smoke at this default found the bitwise check failing)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_mma_triton, moe_router_triton

    held = 32 if ep else 128
    w13 = random_stacked(held, 2048, 2 * 768, 128, False, torch.bfloat16, device="cuda", seed=61)
    w2 = random_stacked(held, 768, 2048, 128, False, torch.bfloat16, device="cuda", seed=62)
    m13, m2 = moe_mma_triton.prepare_stacked(w13), moe_mma_triton.prepare_stacked(w2)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 2048, generator=gen).to(torch.bfloat16).cuda()
    logits = torch.randn(num_tokens, 128, generator=gen).to(torch.bfloat16).cuda()
    block_m = moe_mma_triton.default_config(num_tokens, 8, held).block_m
    start = 32 if ep else 0
    weights, ids, *blocks = moe_router_triton.router_topk_blocks(logits, 8, True, block_m, start, held)
    layout = moe_reference.BlockLayout(*blocks, block_m)
    monkeypatch.setenv(moe_mma_triton.SPLIT_K_ENV, "0")
    sorted_out = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, skip_foreign=ep)
    direct = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, skip_foreign=ep, layout=layout)
    assert torch.equal(direct, sorted_out)
    monkeypatch.setenv(moe_mma_triton.SPLIT_K_ENV, "auto")
    split_direct = moe_mma_triton.fused_moe_w4a16_mma(x, m13, m2, weights, ids, skip_foreign=ep, layout=layout)
    # relative to the whole output: the values run to ~40, where one bf16 ulp is 0.25, and the split
    # path rounds once at the end where the other rounds each pair's row (H100: elementwise up to 0.16)
    err = (split_direct.float() - sorted_out.float()).norm() / sorted_out.float().norm()
    assert err < 1e-2, err
