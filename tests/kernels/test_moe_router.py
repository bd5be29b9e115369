"""The router top-k kernel (``moe_router_triton``) against ``moe_reference.select_experts``
(interpreter on CPU, Qwen3-30B-A3B / Mixtral / Qwen2-MoE router shapes on GPU), and its dispatch;
its sibling that also writes the one-pair-per-block layout (``router_topk_blocks``, against
``local_expert_ids`` and ``direct_block_layout``), ``QSERVE_MOE_DIRECT_BLOCKS`` and ``moe_ops.route``."""

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


def test_dispatch_takes_the_kernel_by_default_on_a_triton_device(monkeypatch):
    """``moe_ops.select_experts``: the kernel on a device Triton serves unless ``QSERVE_FUSED_ROUTER=0``
    (the CPU stands in; the interpreter runs the kernel); the reference elsewhere."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_ops, moe_router_triton

    logits = router_logits(2, 16, torch.float16, seed=3)
    calls = []
    real = moe_router_triton.router_topk
    monkeypatch.setattr(moe_router_triton, "router_topk", lambda *a: calls.append(a) or real(*a))
    with mock.patch.object(kdevice, "triton_serves", lambda device: True):
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "0")
        plain = moe_ops.select_experts(logits, 2, True)
        assert not calls
        monkeypatch.delenv(moe_ops.FUSED_ROUTER_ENV, raising=False)  # the default
        fused = moe_ops.select_experts(logits, 2, True)
        assert len(calls) == 1
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "1")
        moe_ops.select_experts(logits, 2, True)
        assert len(calls) == 2
    assert_same_choice(fused, plain)
    monkeypatch.delenv(moe_ops.FUSED_ROUTER_ENV, raising=False)  # off a Triton device: the reference
    moe_ops.select_experts(logits, 2, True)
    assert len(calls) == 2
    monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "yes")  # a typo is refused, naming the variable
    with pytest.raises(ValueError, match="QSERVE_FUSED_ROUTER='yes'"):
        moe_ops.select_experts(logits, 2, True)
    from tests.kernels.test_moe import random_stacked

    with pytest.raises(ValueError, match="QSERVE_FUSED_ROUTER"):  # refused at load, not at the first step
        moe_ops.prepare_experts(random_stacked(2, 64, 128, 64, True, torch.float16),
                                random_stacked(2, 64, 64, 64, True, torch.float16))  # fmt: skip


# (T, E, k, renormalize, logits dtype, block_m, expert-parallel share: (start, held) or None)
BLOCK_CASES = [
    (1, 128, 8, True, torch.bfloat16, 16, None),  # Qwen3-30B-A3B decode
    (4, 128, 8, True, torch.float16, 16, (32, 32)),  # rank 1 of 4
    (3, 60, 4, False, torch.bfloat16, 4, None),  # E and T not powers of two
    (2, 8, 2, True, torch.float16, 16, (0, 4)),  # Mixtral, rank 0 of 2
    (5, 16, 1, True, torch.float32, 64, (8, 8)),
    (2, 12, 3, False, torch.float32, 16, (3, 6)),  # a share that starts mid-range
]


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "renormalize", "dtype", "block_m", "share"), BLOCK_CASES
)
def test_router_topk_blocks_matches_reference_and_layout(num_tokens, num_experts, top_k, renormalize, dtype,
                                                         block_m, share):  # fmt: skip
    """The choice equals ``select_experts``' (ids then made local), the layout equals
    ``direct_block_layout``'s element for element; every output starts poisoned."""
    from quant_kernels import moe_router_triton

    logits = router_logits(num_tokens, num_experts, dtype, seed=num_tokens * 100 + top_k)
    start, held = share or (0, num_experts)
    weights, ids = moe_reference.select_experts(logits, top_k, renormalize)
    ids = moe_reference.local_expert_ids(ids, start, held)
    real_empty = torch.empty
    poison = lambda *a, **kw: real_empty(*a, **kw).fill_(-7)  # noqa: E731
    with mock.patch.object(moe_router_triton.torch, "empty", poison):
        got = moe_router_triton.router_topk_blocks(logits, top_k, renormalize, block_m, start, held)
    assert_same_choice(got[:2], (weights, ids))
    want = moe_reference.direct_block_layout(ids, held, block_m, skip_foreign=share is not None)
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_padded"), got[2:], want):
        assert g.dtype == torch.int32 and torch.equal(g, w), name
    assert torch.equal(moe_router_triton.router_topk(logits, top_k, renormalize)[0], got[0])  # the same weights


def test_router_topk_blocks_refuses_a_share_outside_the_experts():
    from quant_kernels import moe_router_triton

    with pytest.raises(ValueError, match=r"experts \[6, \+4\)"):
        moe_router_triton.router_topk_blocks(torch.zeros((1, 8)), 2, True, 16, 6, 4)


def test_direct_blocks_setting(monkeypatch):
    from quant_kernels import moe_ops

    for value, want in (("", 32), ("0", 0), ("32", 32), (" 8 ", 8)):
        monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, value)
        assert moe_ops.direct_blocks_limit() == want
    monkeypatch.delenv(moe_ops.DIRECT_BLOCKS_ENV)
    assert moe_ops.direct_blocks_limit() == moe_ops.DEFAULT_DIRECT_BLOCKS == 32  # on by default
    for value in ("-1", "on", "3.5", "1e3"):
        monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, value)
        with pytest.raises(ValueError, match=moe_ops.DIRECT_BLOCKS_ENV):
            moe_ops.direct_blocks_limit()
    from tests.kernels.test_moe import random_stacked

    with pytest.raises(ValueError, match=moe_ops.DIRECT_BLOCKS_ENV):  # refused at load, not at the first step
        moe_ops.prepare_experts(random_stacked(2, 64, 128, 64, True, torch.float16),
                                random_stacked(2, 64, 64, 64, True, torch.float16))  # fmt: skip


@pytest.mark.parametrize("share", [None, (8, 8)], ids=["all-experts", "rank-1-of-2"])
def test_route_hands_the_router_layout_to_the_experts(monkeypatch, share):
    """``moe_ops.route`` + ``moe_experts`` as the MoE block calls them, on a device Triton serves (the
    CPU stands in, the interpreter runs the kernels): with ``QSERVE_MOE_DIRECT_BLOCKS`` and the fused
    router, one router launch and no sort, and the layer's output bit for bit the sorted path's; the
    layout only where T*k fits the limit, the fused router is on and the experts run a grouped kernel."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_mma_triton, moe_ops, moe_router_triton, moe_triton
    from tests.kernels.test_moe import random_stacked

    num_experts, top_k, hidden, inter = 16, 4, 128, 64
    start, held = share or (0, num_experts)
    w13 = random_stacked(held, hidden, 2 * inter, 64, False, torch.bfloat16, seed=5)
    w2 = random_stacked(held, inter, hidden, 64, False, torch.bfloat16, seed=6)
    calls = {"router_topk_blocks": 0, "moe_align_block_size": 0}

    def counted(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(moe_router_triton, "router_topk_blocks")
    counted(moe_triton, "moe_align_block_size")
    monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "1")
    monkeypatch.delenv(moe_ops.MOE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(moe_ops.FUSED_MOE_ENV, raising=False)
    monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, "0")  # off: the sorted layout
    with mock.patch.object(kdevice, "triton_serves", lambda device: True), \
            mock.patch.object(kdevice, "capability", lambda device: (9, 0)):  # fmt: skip
        prepared = moe_ops.prepare_experts(w13, w2, skip_foreign=share is not None)
        assert prepared.kind == "mma"
        logits = router_logits(3, num_experts, torch.bfloat16, seed=7)
        x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
        plain = moe_ops.route(logits, top_k, True, prepared, start)
        assert plain.layout is None and calls["router_topk_blocks"] == 0
        want = moe_ops.moe_experts(x, prepared, plain.weights, plain.ids, plain.layout)
        assert calls["moe_align_block_size"] == 1

        monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, "12")  # 3 tokens x top-4: just fits
        direct = moe_ops.route(logits, top_k, True, prepared, start)
        assert calls["router_topk_blocks"] == 1 and direct.layout is not None
        assert direct.layout.block_m == moe_mma_triton.default_config(3, top_k, held).block_m
        assert torch.equal(direct.ids, plain.ids) and torch.equal(direct.weights, plain.weights)
        got = moe_ops.moe_experts(x, prepared, direct.weights, direct.ids, direct.layout)
        assert calls["moe_align_block_size"] == 1  # no second sort
        assert torch.equal(got, want)

        assert moe_ops.route(logits[:2].clone(), 8, True, prepared, start).layout is None  # 16 pairs > 12
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "0")
        assert moe_ops.route(logits, top_k, True, prepared, start).layout is None  # torch router: no layout
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "1")
        monkeypatch.setenv(moe_ops.FUSED_MOE_ENV, "0")
        loop = moe_ops.prepare_experts(w13, w2, skip_foreign=share is not None)
        assert loop.kind == "per_expert" and moe_ops.route(logits, top_k, True, loop, start).layout is None
    assert calls["router_topk_blocks"] == 1


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4, 32])
@pytest.mark.parametrize("share", [None, (32, 32)], ids=["all-experts", "rank-1-of-4"])
def test_router_topk_blocks_on_gpu(num_tokens, share):
    """Qwen3-30B-A3B's router (128 experts, top-8, bf16 logits) against the reference and the layout oracle."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_router_triton

    logits = router_logits(num_tokens, 128, torch.bfloat16, seed=num_tokens, device="cuda")
    start, held = share or (0, 128)
    weights, ids = moe_reference.select_experts(logits, 8, True)
    ids = moe_reference.local_expert_ids(ids, start, held)
    got = moe_router_triton.router_topk_blocks(logits, 8, True, 16, start, held)
    assert_same_choice(got[:2], (weights, ids))
    want = moe_reference.direct_block_layout(ids, held, 16, skip_foreign=share is not None)
    assert all(torch.equal(g, w) for g, w in zip(got[2:], want))
