"""The router top-k kernel (``moe_router_triton``) against ``moe_reference.select_experts``
(interpreter on CPU, Qwen3-30B-A3B / Mixtral / Qwen2-MoE router shapes on GPU), and its dispatch;
its sibling that also writes the one-pair-per-block layout (``router_topk_blocks``, against
``local_expert_ids`` and ``direct_block_layout``), ``QSERVE_MOE_DIRECT_BLOCKS`` and ``moe_ops.route``;
the opt-in launch that also computes the logits (``router_gemm_topk_blocks``, against ``F.linear`` in the
model dtype then the same oracles, and on GPU against ``F.linear`` + ``router_topk_blocks``, in a CUDA
graph too), ``QSERVE_FUSED_ROUTER_GEMM`` and ``moe_ops.route_hidden`` (and the MoE block through it)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from quant_kernels import moe_reference

triton = pytest.importorskip("triton")


def router_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int, device: str = "cpu"):
    """Distinct logits per row (a random permutation of a spread), so no two probabilities tie and
    the top-k ids are defined; scaled as a trained router's are (a few units)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
    logits = torch.stack(rows).float() * (8.0 / num_experts) - 4.0  # [T, E], steps of 8/E
    return logits.to(dtype).to(device)


def router_problem(num_tokens: int, num_experts: int, hidden_size: int, dtype: torch.dtype, seed: int,
                   device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A router's input ``[T, H]`` and weight ``[E, H]`` whose logits ``[T, E]`` (returned too) every
    correct GEMM gets bit for bit: distinct multiples of 1/16 per row (no two probabilities tie), carried
    by an identity in the first T hidden columns, whose weights also cancel the dot products of the other
    columns (random multiples of 1/4 in [-1/4, 1/4], hidden and weight: every column is summed). Every
    product and partial sum is a multiple of 1/64 well inside fp32's 24 bits, so the sum is exact in any
    order, and the logits (below 16 in magnitude) are exact in bf16's 8 bits: no rounding anywhere, so
    the interpreter's truncating bf16 cast and cuBLAS' order (or reduced-precision reductions) change
    nothing."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.stack([torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)])  # [T, E]
    logits = (spread.double() - num_experts // 2) / 16  # [T, E]
    rest = hidden_size - num_tokens
    noise_h = torch.randint(-1, 2, (num_tokens, rest), generator=gen).double() / 4  # [T, H - T]
    noise_w = torch.randint(-1, 2, (num_experts, rest), generator=gen).double() / 4  # [E, H - T]
    hidden = torch.cat([torch.eye(num_tokens, dtype=torch.float64), noise_h], 1)  # [T, H]
    weight = torch.cat([(logits - noise_h @ noise_w.T).T, noise_w], 1)  # [E, H]
    assert weight.abs().max() < 16, "a router weight past bf16's exact multiples of 1/16"
    return tuple(t.to(dtype).to(device) for t in (hidden, weight, logits))


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


def assert_refused_at_load(env: str) -> None:
    """``prepare_experts`` (the load) refuses the bad value of ``env`` now in the environment, naming it:
    a typo stops the load, not the first step."""
    from quant_kernels import moe_ops
    from tests.kernels.test_moe import random_stacked

    with pytest.raises(ValueError, match=env):
        moe_ops.prepare_experts(random_stacked(2, 64, 128, 64, True, torch.float16),
                                random_stacked(2, 64, 64, 64, True, torch.float16))  # fmt: skip


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
    assert_refused_at_load(moe_ops.DIRECT_BLOCKS_ENV)


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


# (T, E, H, k, renormalize, dtype, block_m, expert-parallel share: (start, held) or None)
GEMM_CASES = [
    (1, 128, 2048, 8, True, torch.bfloat16, 16, None),  # Qwen3-30B-A3B decode, its hidden size
    (4, 128, 1000, 8, True, torch.float16, 16, (32, 32)),  # rank 1 of 4; H past one step, the last one masked
    (3, 60, 256, 4, False, torch.bfloat16, 16, None),  # Qwen1.5-MoE-like: E and T not powers of two
    (4, 60, 256, 4, True, torch.float16, 4, (15, 30)),  # a share that starts mid-range
    (1, 128, 256, 4, False, torch.float16, 16, None),
    (3, 128, 256, 8, False, torch.bfloat16, 16, (64, 64)),  # the last rank
]


def reference_blocks(hidden, weight, top_k, renormalize, block_m, share):  # noqa: ANN001, ANN201
    """The fused launch's oracle: F.linear in the model dtype, then ``select_experts``, the ids made
    local, ``direct_block_layout``: (weights, ids, sorted_ids, expert_ids, num_padded, logits)."""
    logits = F.linear(hidden, weight)  # [T, E] in the model dtype
    start, held = share or (0, weight.shape[0])
    weights, ids = moe_reference.select_experts(logits, top_k, renormalize)
    ids = moe_reference.local_expert_ids(ids, start, held)
    layout = moe_reference.direct_block_layout(ids, held, block_m, skip_foreign=share is not None)
    return (weights, ids, *layout, logits)


def assert_same_blocks(got, want) -> None:
    """The choice within float32 rounding (``assert_same_choice``), the layout and the logits equal."""
    assert_same_choice(got[:2], want[:2])
    for name, g, w in zip(("sorted_ids", "expert_ids", "num_padded", "logits"), got[2:], want[2:]):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w.cpu()), name


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "hidden_size", "top_k", "renormalize", "dtype", "block_m", "share"), GEMM_CASES
)
def test_router_gemm_topk_blocks_matches_reference(num_tokens, num_experts, hidden_size, top_k, renormalize,
                                                   dtype, block_m, share):  # fmt: skip
    """The logits equal F.linear's in the model dtype, the choice ``select_experts``' on them (ids made
    local), the layout ``direct_block_layout``'s, every output poisoned first; and all six equal the two
    launches' (F.linear, then ``router_topk_blocks``) bit for bit; the counter is left zero."""
    from quant_kernels import moe_router_triton

    hidden, weight, exact = router_problem(num_tokens, num_experts, hidden_size, dtype, seed=num_tokens * 10 + top_k)
    want = reference_blocks(hidden, weight, top_k, renormalize, block_m, share)
    assert torch.equal(want[5], exact)  # the problem's premise: F.linear is exact here
    start, held = share or (0, num_experts)
    real_empty = torch.empty
    poison = lambda *a, **kw: real_empty(*a, **kw).fill_(-7)  # noqa: E731
    with mock.patch.object(moe_router_triton.torch, "empty", poison):
        got = moe_router_triton.router_gemm_topk_blocks(hidden, weight, top_k, renormalize, block_m, start, held)
    assert_same_blocks(got, want)
    two = moe_router_triton.router_topk_blocks(F.linear(hidden, weight), top_k, renormalize, block_m, start, held)
    assert all(torch.equal(g, w) for g, w in zip(got, two))
    assert moe_router_triton.arrival_counter(hidden.device).item() == 0


def test_router_gemm_topk_blocks_twice_and_on_any_logits():
    """Two launches in a row (the second finds the counter its last program reset), the second on
    Gaussian data: its logits within one ulp of F.linear's (another fp32 sum order), its choice and layout
    ``router_topk_blocks``' on those same logits bit for bit; its shape checks refuse by name."""
    from quant_kernels import moe_router_triton

    gen = torch.Generator().manual_seed(11)
    first = router_problem(4, 128, 512, torch.float16, seed=1)[:2]
    hidden = torch.randn(4, 512, generator=gen).to(torch.float16)  # [T, H]
    weight = (torch.randn(128, 512, generator=gen) * 0.05).to(torch.float16)  # [E, H]: logits of a few units
    counter = moe_router_triton.arrival_counter(torch.device("cpu"))
    for h, w in (first, (hidden, weight)):
        got = moe_router_triton.router_gemm_topk_blocks(h, w, 8, True, 16, 32, 32)
        assert counter.item() == 0
    assert_same_blocks(got[:5], moe_router_triton.router_topk_blocks(got[5], 8, True, 16, 32, 32))
    torch.testing.assert_close(got[5], F.linear(hidden, weight), rtol=2**-10, atol=0)
    assert_same_blocks(
        moe_router_triton.router_gemm_topk_blocks(*first, 8, True, 16, 32, 32),
        reference_blocks(*first, 8, True, 16, (32, 32)),
    )
    with pytest.raises(ValueError, match="top_k=9"):
        moe_router_triton.router_gemm_topk_blocks(hidden, weight[:8], 9, True, 16)
    with pytest.raises(ValueError, match=r"expected \[T, H\] and \[E, H\]"):
        moe_router_triton.router_gemm_topk_blocks(hidden, weight[:, :256], 8, True, 16)
    with pytest.raises(ValueError, match="one dtype"):
        moe_router_triton.router_gemm_topk_blocks(hidden, weight.bfloat16(), 8, True, 16)
    with pytest.raises(ValueError, match=r"experts \[100, \+32\)"):
        moe_router_triton.router_gemm_topk_blocks(hidden, weight, 8, True, 16, 100, 32)


@pytest.mark.parametrize("num_tokens,top_k,renormalize", [(1, 8, True), (3, 8, False), (4, 2, True)])
def test_packed_topk_picks_what_the_two_reductions_pick(monkeypatch, num_tokens, top_k, renormalize):
    """QSERVE_MOE_PACKED_TOPK=1: the router GEMM launch's top-k as one max over packed (probability, id)
    keys gives the same six outputs bit for bit as the max-then-min rounds, on Gaussian logits and on
    logits with exact ties (duplicated router rows: the lower id first), for all experts and one rank's
    share; the setting is refused by name when misspelt, also at load."""
    from quant_kernels import moe_router_triton

    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    hidden = torch.randn(num_tokens, 256, generator=gen).to(torch.float16)  # [T, H]
    weight = (torch.randn(64, 256, generator=gen) * 0.1).to(torch.float16)  # [E, H]
    tied = weight.clone()
    tied[5] = hidden[0] * 0.05  # token 0's largest logit ...
    tied[9], tied[40], tied[41] = tied[5], tied[5], tied[2]  # ... for experts 5, 9 and 40 at once; 2 and 41 tie
    for w in (weight, tied):
        for share in ((0, 64), (16, 32)):
            outputs = {}
            for value in ("0", "1"):
                monkeypatch.setenv(moe_router_triton.PACKED_TOPK_ENV, value)
                outputs[value] = moe_router_triton.router_gemm_topk_blocks(hidden, w, top_k, renormalize, 16, *share)
            assert all(torch.equal(a, b) for a, b in zip(outputs["0"], outputs["1"])), share
    if top_k >= 3:  # the tie at the top went to the lower ids, in order (all experts' ids: the first share)
        monkeypatch.setenv(moe_router_triton.PACKED_TOPK_ENV, "1")
        ids = moe_router_triton.router_gemm_topk_blocks(hidden, tied, top_k, renormalize, 16)[1]
        assert ids[0, :3].tolist() == [5, 9, 40]
    monkeypatch.delenv(moe_router_triton.PACKED_TOPK_ENV)
    assert moe_router_triton.packed_topk_requested() is True  # the default since the nineteenth session
    monkeypatch.setenv(moe_router_triton.PACKED_TOPK_ENV, "0")
    assert moe_router_triton.packed_topk_requested() is False
    for bad in ("yes", "2", "on"):
        monkeypatch.setenv(moe_router_triton.PACKED_TOPK_ENV, bad)
        with pytest.raises(ValueError, match=f"QSERVE_MOE_PACKED_TOPK={bad!r}"):
            moe_router_triton.packed_topk_requested()
    from tests.kernels.test_moe_mma import assert_refused_at_load

    assert_refused_at_load(monkeypatch, moe_router_triton.PACKED_TOPK_ENV, good="1", bad="on")


def test_fused_router_gemm_setting(monkeypatch):
    """``QSERVE_FUSED_ROUTER_GEMM``: on unless "0"; anything but 0 / 1 refused by name, at load too."""
    from quant_kernels import moe_ops

    monkeypatch.delenv(moe_ops.FUSED_ROUTER_GEMM_ENV, raising=False)
    assert moe_ops.fused_router_gemm_requested()  # on by default (H100 smoke at f609d24, bench/RESULTS.md)
    for value, want in (("", True), ("0", False), (" 0 ", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_GEMM_ENV, value)
        assert moe_ops.fused_router_gemm_requested() == want
    for value in ("yes", "on", "2", "true"):
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_GEMM_ENV, value)
        with pytest.raises(ValueError, match=f"QSERVE_FUSED_ROUTER_GEMM={value!r}"):
            moe_ops.fused_router_gemm_requested()
    assert_refused_at_load(moe_ops.FUSED_ROUTER_GEMM_ENV)


@pytest.mark.parametrize("share", [None, (8, 8)], ids=["all-experts", "rank-1-of-2"])
def test_route_hidden_fuses_the_router_gemm_where_route_lays_out_blocks(monkeypatch, share):
    """``moe_ops.route_hidden`` as the MoE block calls it, on a device Triton serves (the CPU stands in, the
    interpreter runs the kernels): with ``QSERVE_FUSED_ROUTER_GEMM=1`` and a step that takes the direct
    layout, one launch (no F.linear, no ``router_topk_blocks``), its routing and the layer's output bit for
    bit the two launches'; F.linear + ``route`` wherever ``route`` lays out no blocks (T*k past the limit,
    ``QSERVE_FUSED_ROUTER=0``, the per-expert loop) and with the switch off."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_ops, moe_router_triton
    from tests.kernels.test_moe import random_stacked

    num_experts, top_k, hidden_size, inter = 16, 4, 128, 64
    start, held = share or (0, num_experts)
    w13 = random_stacked(held, hidden_size, 2 * inter, 64, False, torch.bfloat16, seed=5)
    w2 = random_stacked(held, inter, hidden_size, 64, False, torch.bfloat16, seed=6)
    hidden, weight, _ = router_problem(3, num_experts, hidden_size, torch.bfloat16, seed=7)
    calls = {"router_gemm_topk_blocks": 0, "router_topk_blocks": 0}

    def counted(name):
        real = getattr(moe_router_triton, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(moe_router_triton, name, wrapper)

    counted("router_gemm_topk_blocks")
    counted("router_topk_blocks")
    for name in (moe_ops.FUSED_ROUTER_ENV, moe_ops.MOE_KERNEL_ENV, moe_ops.FUSED_MOE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, "12")  # 3 tokens x top-4: just fits
    monkeypatch.setenv(moe_ops.FUSED_ROUTER_GEMM_ENV, "0")
    with mock.patch.object(kdevice, "triton_serves", lambda device: True), \
            mock.patch.object(kdevice, "capability", lambda device: (9, 0)):  # fmt: skip
        prepared = moe_ops.prepare_experts(w13, w2, skip_foreign=share is not None)
        assert prepared.kind == "mma"
        two = moe_ops.route_hidden(hidden, weight, top_k, True, prepared, start)
        assert two.layout is not None and calls == {"router_gemm_topk_blocks": 0, "router_topk_blocks": 1}
        want = moe_ops.moe_experts(hidden, prepared, two.weights, two.ids, two.layout)

        monkeypatch.setenv(moe_ops.FUSED_ROUTER_GEMM_ENV, "1")
        one = moe_ops.route_hidden(hidden, weight, top_k, True, prepared, start)
        assert calls == {"router_gemm_topk_blocks": 1, "router_topk_blocks": 1}
        assert one.layout.block_m == two.layout.block_m
        for name in ("weights", "ids"):
            assert torch.equal(getattr(one, name), getattr(two, name)), name
        for name in ("sorted_ids", "expert_ids", "num_padded"):
            assert torch.equal(getattr(one.layout, name), getattr(two.layout, name)), name
        assert torch.equal(moe_ops.moe_experts(hidden, prepared, one.weights, one.ids, one.layout), want)

        monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, "8")  # 12 pairs: the sorted path, no fused launch
        assert moe_ops.route_hidden(hidden, weight, top_k, True, prepared, start).layout is None
        monkeypatch.setenv(moe_ops.DIRECT_BLOCKS_ENV, "12")
        monkeypatch.setenv(moe_ops.FUSED_ROUTER_ENV, "0")  # the torch router: no layout, no fused launch
        assert moe_ops.route_hidden(hidden, weight, top_k, True, prepared, start).layout is None
        monkeypatch.delenv(moe_ops.FUSED_ROUTER_ENV)
        monkeypatch.setenv(moe_ops.FUSED_MOE_ENV, "0")
        loop = moe_ops.prepare_experts(w13, w2, skip_foreign=share is not None)
        assert loop.kind == "per_expert"
        assert moe_ops.route_hidden(hidden, weight, top_k, True, loop, start).layout is None
    assert calls == {"router_gemm_topk_blocks": 1, "router_topk_blocks": 1}


def test_route_hidden_and_the_moe_block_fall_back_off_triton(monkeypatch):
    """On the CPU (no Triton device) ``QSERVE_FUSED_ROUTER_GEMM=1`` changes nothing: ``route_hidden`` is
    F.linear + ``route`` (the reference), no fused launch, and the MoE block's output equals the switch off's."""
    from qserve.layers.moe import SparseMoeBlock
    from quant_kernels import moe_ops, moe_router_triton

    num_experts, top_k, hidden_size, inter = 8, 2, 64, 32
    gen = torch.Generator().manual_seed(3)
    block = SparseMoeBlock(prefix="mlp", hidden_size=hidden_size, num_experts=num_experts, top_k=top_k,
                           intermediate_size=inter, renormalize=True, expert_names=("gate_proj", "up_proj", "down_proj"),
                           quantized=False, dtype=torch.float32)  # fmt: skip
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(num_experts, hidden_size, generator=gen))
        block.w_gate_up.copy_(torch.randn(block.w_gate_up.shape, generator=gen) * 0.1)
        block.w_down.copy_(torch.randn(block.w_down.shape, generator=gen) * 0.1)
    block.process_after_loading()
    hidden = torch.randn(3, hidden_size, generator=gen)  # [T, H]
    fused = mock.patch.object(moe_router_triton, "router_gemm_topk_blocks", side_effect=AssertionError("launched"))
    monkeypatch.setenv(moe_ops.FUSED_ROUTER_GEMM_ENV, "0")
    want = block(hidden)
    monkeypatch.setenv(moe_ops.FUSED_ROUTER_GEMM_ENV, "1")
    with fused:
        assert torch.equal(block(hidden), want)
        routing = moe_ops.route_hidden(hidden, block.gate.weight, top_k, True, block.prepared)
    ref_weights, ref_ids = moe_reference.select_experts(F.linear(hidden, block.gate.weight), top_k, True)
    assert routing.layout is None and torch.equal(routing.ids, ref_ids) and torch.equal(routing.weights, ref_weights)


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("packed", ["0", "1"], ids=["topk", "packed-topk"])
def test_router_gemm_topk_blocks_on_gpu(monkeypatch, num_tokens, dtype, packed):
    """Qwen3-30B-A3B's router (128 x 2048, top-8, renormalized, block_m 16) fused against F.linear +
    ``router_topk_blocks``: eagerly, then captured in a CUDA graph replayed twice with new hidden states
    and router weights (the counter reset by each launch's last program): ids and layout equal, weights
    close, the logits F.linear's; also with QSERVE_MOE_PACKED_TOPK=1's one-reduction rounds."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_router_triton

    monkeypatch.setenv(moe_router_triton.PACKED_TOPK_ENV, packed)

    def fused(hidden, weight):  # noqa: ANN001, ANN202
        return moe_router_triton.router_gemm_topk_blocks(hidden, weight, 8, True, 16)

    def two_launches(hidden, weight):  # noqa: ANN001, ANN202
        logits = F.linear(hidden, weight)  # [T, E]
        return (*moe_router_triton.router_topk_blocks(logits, 8, True, 16), logits)

    hidden, weight, exact = router_problem(num_tokens, 128, 2048, dtype, seed=num_tokens, device="cuda")
    got = fused(hidden, weight)
    assert torch.equal(got[5], exact)
    assert_same_blocks(got, two_launches(hidden, weight))
    static_h, static_w = hidden.clone(), weight.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused(static_h, static_w)
    for seed in (101, 102):
        hidden, weight, exact = router_problem(num_tokens, 128, 2048, dtype, seed=seed, device="cuda")
        static_h.copy_(hidden)
        static_w.copy_(weight)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured[5], exact), seed
        assert_same_blocks(captured, two_launches(hidden, weight))
    assert moe_router_triton.arrival_counter(hidden.device).item() == 0
