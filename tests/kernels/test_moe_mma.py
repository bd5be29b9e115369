"""The MMA-operand fused MoE kernel (``quant_kernels.moe_mma_triton``, QSERVE_MOE_KERNEL=mma)
against the PyTorch reference: the interpreter on CPU (small shapes), real sizes on a GPU.

Outputs and the intermediate start as NaN (every row a pair owns must be written), and the
tolerances are the dense MMA kernel tests' (tests/kernels/test_w4a16_mma.py) per dtype.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from quant_kernels import moe_reference
from quant_kernels.moe_layout import StackedQuantWeight
from tests.kernels.test_moe import _as_f32, _rank_share, random_stacked, routing

triton = pytest.importorskip("triton")

from quant_kernels import moe_mma_triton as moe_mma  # noqa: E402
from quant_kernels.repack import mma_unshuffle  # noqa: E402

# Relative Frobenius error bound and (atol relative to max|ref|, rtol) per activation dtype.
TOL = {torch.float16: (3e-3, 4e-3, 1e-2), torch.bfloat16: (2e-2, 3e-2, 5e-2)}


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    rel_bound, atol_rel, rtol = TOL[dtype]
    rel = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rel < rel_bound, f"relative error {rel:.2e} >= {rel_bound:.0e}"
    torch.testing.assert_close(out.float(), ref, atol=atol_rel * ref.abs().max().item(), rtol=rtol)


@pytest.fixture
def poisoned(monkeypatch):
    """Float buffers start as NaN (``torch.zeros`` stays zeros: skipped pairs' rows). ``torch.empty``
    is patched process-wide (``moe_mma.torch`` is torch), so integer tensors (the shuffled words)
    are left alone."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(moe_mma.torch, "empty", empty)


def layer(num_experts, hidden, inter, group, sym, dtype, seed):
    """gate_up (K=H, N=2I) and down (K=I, N=H); group -1: per channel."""
    g13, g2 = (hidden, inter) if group == -1 else (group, min(group, inter))
    w13 = random_stacked(num_experts, hidden, 2 * inter, g13, sym, dtype, seed=seed)
    w2 = random_stacked(num_experts, inter, hidden, g2, sym, dtype, seed=seed + 1)
    return w13, w2


def run_mma(x, w13, w2, weights, ids, config=None, skip_foreign=False):
    return moe_mma.fused_moe_w4a16_mma(
        x, moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2), weights, ids, config, skip_foreign=skip_foreign
    )


# (tokens, experts, top_k, hidden, inter, group, sym, dtype, config (block_m, block_n) or None: the default)
CASES = [
    (1, 8, 2, 128, 64, 128, True, torch.float16, None),
    (5, 8, 2, 128, 64, 64, False, torch.float16, (16, 64)),
    (17, 8, 2, 128, 64, 32, False, torch.bfloat16, (16, 64)),  # 4 groups per K-tile: scales on the weights
    (9, 4, 3, 256, 128, 128, False, torch.bfloat16, (16, 128)),  # two K-tiles, 64 gate + 64 up columns a tile
    (5, 4, 2, 256, 128, -1, True, torch.float16, (16, 64)),  # per-channel scales
    (40, 4, 2, 192, 64, 64, True, torch.float16, None),  # K not a multiple of 128 (masked x), 64-row blocks
    (3, 6, 2, 96, 192, 32, True, torch.float16, (16, 128)),  # I = 3 tiles of 64 gate columns; H = 96: masked N
]


@pytest.mark.parametrize(
    "case", CASES, ids=[f"T{c[0]}-E{c[1]}-k{c[2]}-H{c[3]}-I{c[4]}-g{c[5]}-{'sym' if c[6] else 'asym'}" for c in CASES]
)
def test_matches_reference(case, poisoned) -> None:
    num_tokens, num_experts, top_k, hidden, inter, group, sym, dtype, cfg = case
    seed = num_tokens + hidden + inter
    w13, w2 = layer(num_experts, hidden, inter, group, sym, dtype, seed)
    x, weights, ids = routing(num_tokens, num_experts, top_k, hidden, dtype, seed)
    ref = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    config = moe_mma.MoEMmaConfig(*cfg) if cfg else None
    assert_matches(run_mma(x, w13, w2, weights, ids, config), ref, dtype)


def test_default_config_reaches_both_tiles() -> None:
    assert moe_mma.default_config(1, 8, 128).block_m == 16
    assert moe_mma.default_config(512, 8, 128).block_m == 64
    # the (40, 4, 2) case above: 20 pairs per expert take the 64-row blocks
    assert moe_mma.default_config(40, 2, 4).block_m == 64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_skips_foreign_pairs(dtype, poisoned) -> None:
    """One rank's experts (expert parallelism) with the sentinel ids: skipped pairs add nothing."""
    w13, w2 = layer(8, 128, 64, 64, False, dtype, seed=31)
    x, weights, ids = routing(7, 8, 2, 128, dtype, seed=33)
    ids = torch.randint(0, 8, ids.shape, generator=torch.Generator().manual_seed(34), dtype=torch.int32)
    local = moe_reference.local_expert_ids(ids, 4, 4)  # rank 1 of 2
    assert bool((local == 4).any()) and bool((local < 4).any())
    mine13, mine2 = _rank_share(w13, 1, 2), _rank_share(w2, 1, 2)
    ref = moe_reference.fused_moe_w4a16(x.float(), _as_f32(mine13), _as_f32(mine2), weights, local)
    out = run_mma(x, mine13, mine2, weights, local, moe_mma.MoEMmaConfig(16, 64), skip_foreign=True)
    assert_matches(out, ref, dtype)


def test_one_expert_gets_every_pair(poisoned) -> None:
    """Every pair on one expert (the others idle): several full blocks of it, padding in the last."""
    w13, w2 = layer(8, 128, 64, 64, False, torch.float16, seed=41)
    x, weights, _ = routing(37, 8, 1, 128, torch.float16, seed=42)
    ids = torch.full((37, 1), 5, dtype=torch.int32)
    weights = torch.rand(37, 1, generator=torch.Generator().manual_seed(43))
    ref = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    assert_matches(run_mma(x, w13, w2, weights, ids, moe_mma.MoEMmaConfig(16, 64)), ref, torch.float16)


def test_stacked_layout_is_each_experts_shuffle() -> None:
    """``prepare_stacked`` holds expert e's own shuffle in slot e, zeros as fp16 z - 8."""
    w13, _ = layer(3, 128, 64, 64, False, torch.float16, seed=51)
    stacked = moe_mma.prepare_stacked(w13, kwidth=4)
    assert stacked.qweight.shape[0] == 3 and stacked.zeros.dtype == torch.float16
    for e in range(3):
        back = mma_unshuffle(stacked.expert(e))
        assert torch.equal(back.qweight, w13.qweight[e]) and torch.equal(back.zeros, w13.zeros[e])
    assert stacked.nbytes() == sum(
        t.numel() * t.element_size() for t in (stacked.qweight, stacked.scales, stacked.zeros)
    )


def test_supports() -> None:
    w13, w2 = layer(2, 128, 64, 64, True, torch.float16, seed=61)
    assert moe_mma.supports(w13, w2)
    w13_odd, w2_odd = layer(2, 128, 48, 16, True, torch.float16, seed=62)  # I not a multiple of 64
    assert not moe_mma.supports(w13_odd, w2_odd)
    act_order = StackedQuantWeight(4, 64, w13.qweight, w13.scales, None, torch.arange(128).repeat(2, 1))
    assert not moe_mma.supports(act_order, w2)


def test_dispatch_selects_the_mma_kernel(monkeypatch) -> None:
    """By default (``QSERVE_MOE_KERNEL`` unset) on a device Triton serves (the CPU stands in, the
    interpreter runs the kernel): the experts are shuffled once, the canonical stack is not held, and
    ``moe_experts`` runs the MMA kernel; ``QSERVE_MOE_KERNEL=fused`` keeps the canonical stack for the
    fused kernel; ``QSERVE_FUSED_MOE=0`` takes the per-expert loop whichever kernel is named (the H100
    smoke of 2026-12-05 caught the MMA kernel taken there)."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_ops

    w13, w2 = layer(4, 128, 64, 64, False, torch.float16, seed=71)
    x, weights, ids = routing(6, 4, 2, 128, torch.float16, seed=72)
    with mock.patch.object(kdevice, "triton_serves", lambda device: True):
        with mock.patch.object(kdevice, "capability", lambda device: (9, 0)):
            monkeypatch.delenv(moe_ops.MOE_KERNEL_ENV, raising=False)
            prepared = moe_ops.prepare_experts(w13, w2)
            monkeypatch.setenv(moe_ops.FUSED_MOE_ENV, "0")
            loop = moe_ops.prepare_experts(w13, w2)
            monkeypatch.delenv(moe_ops.FUSED_MOE_ENV)
            monkeypatch.setenv(moe_ops.MOE_KERNEL_ENV, "fused")
            fused = moe_ops.prepare_experts(w13, w2)
    assert (prepared.kind, prepared.fused, prepared.graph_safe) == ("mma", True, True)
    assert isinstance(prepared.gate_up, moe_mma.StackedMmaWeight) and prepared.gate_up.kwidth == 2
    assert prepared.nbytes() == prepared.gate_up.nbytes() + prepared.down.nbytes() > 0
    assert (fused.kind, fused.fused) == ("stacked", True)
    assert (loop.kind, loop.graph_safe) == ("per_expert", False)
    ref = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    assert_matches(moe_ops.moe_experts(x, prepared, weights, ids), ref, torch.float16)


# Split-K: H = 320 is 3 K-tiles of 128 (the last masked), I = 192 is 2 (NG = 2 groups of 64 each):
# split 2 leaves ranges of 2 + 1 tiles, 3 one tile each (down: one empty), 4 an empty range on both.
SPLIT_CASES = [
    (split, sym, dtype) for split in (2, 3, 4) for sym, dtype in ((True, torch.float16), (False, torch.bfloat16))
]


@pytest.mark.parametrize(
    "split,sym,dtype", SPLIT_CASES, ids=[f"s{c[0]}-{'sym' if c[1] else 'asym'}-{str(c[2])[6:]}" for c in SPLIT_CASES]
)
def test_split_k_matches_reference(split, sym, dtype, poisoned) -> None:
    """Both GEMMs split along K: down's weighted partials added into the token rows (its fp32
    accumulator starts NaN: the gate_up launch must zero it), gate_up's reduced by each tile's last
    program; a second call gives the same bits (the counters were reset, the workspace is per call)."""
    w13, w2 = layer(8, 320, 192, 64, sym, dtype, seed=81 + split)
    x, weights, ids = routing(5, 8, 2, 320, dtype, seed=82 + split)
    ref = moe_reference.fused_moe_w4a16(x.float(), _as_f32(w13), _as_f32(w2), weights, ids)
    p13, p2 = moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2)
    config = moe_mma.MoEMmaConfig(16, 64, split_k=split)
    first = moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids, config)
    assert_matches(first, ref, dtype)
    assert torch.equal(moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids, config), first)
    assert not moe_mma.split_counters(x.device, 1).any(), "a tile's arrival counter was left set"


@pytest.mark.parametrize("split,tokens", [(2, 5), (4, 1), (3, 7)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_cast_is_the_torch_cast(monkeypatch, split, tokens, dtype, poisoned) -> None:
    """QSERVE_MOE_FUSED_CAST=1: the split-K down launch writes the layer's output in the activation dtype
    itself (each column tile's last program, idle pair blocks arriving too): the torch cast of the fp32
    accumulator (the interpreter runs the programs in one order, so the atomic sums are the same;
    ``assert_cast_of``), for the tokens of a direct layout's decode (every block one pair) and a sorted one with
    padding blocks; the counters are left zero, and a second call gives the same bits."""
    w13, w2 = layer(8, 320, 192, 64, dtype == torch.float16, dtype, seed=101 + split)
    x, weights, ids = routing(tokens, 8, 2, 320, dtype, seed=102 + split)
    p13, p2 = moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2)
    config = moe_mma.MoEMmaConfig(16, 64, split_k=split)
    monkeypatch.setenv(moe_mma.FUSED_CAST_ENV, "0")
    want = moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids, config)
    casts = []
    real = moe_mma._launch
    monkeypatch.setattr(moe_mma, "_launch", lambda *a, **kw: casts.append(kw.get("cast_out")) or real(*a, **kw))
    monkeypatch.setenv(moe_mma.FUSED_CAST_ENV, "1")
    got = moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids, config)
    assert casts[-1] is got, "the down launch did not write the output itself"
    assert_cast_of(got, want)
    assert not moe_mma.split_counters(x.device, 1 << 10).any(), "a column tile's arrival counter was left set"
    assert torch.equal(moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids, config), got)


def assert_cast_of(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp16: the same bits. bf16: within one bf16 unit in the last place, toward zero: the interpreter
    converts fp32 to bf16 by truncation where torch and the GPU (cvt.rn) round to nearest even."""
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    if got.dtype == torch.float16:
        assert torch.equal(got, want)
        return
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got.float().abs() <= want.float().abs()).all(), "not a truncation of the same sum"


def test_fused_cast_setting(monkeypatch) -> None:
    """``QSERVE_MOE_FUSED_CAST``: on unset, empty or "1" (the default since the nineteenth session's H100
    smoke), off for "0"; anything else refused by name, also at load (``moe_ops.prepare_experts``), not at
    a later step."""
    env = moe_mma.FUSED_CAST_ENV
    monkeypatch.delenv(env, raising=False)
    assert moe_mma.fused_cast_requested() is True
    for value, want in (("", True), ("0", False), (" 0", False), ("1", True), (" 1", True)):
        monkeypatch.setenv(env, value)
        assert moe_mma.fused_cast_requested() is want, value
    for value in ("yes", "2", "true", "on"):
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError, match=f"QSERVE_MOE_FUSED_CAST={value!r}"):
            moe_mma.fused_cast_requested()
    assert_refused_at_load(monkeypatch, env, good="1", bad="on")


@pytest.mark.parametrize("cast", ["0", "1"], ids=["torch-cast", "fused-cast"])
def test_split_k_skips_foreign_pairs(monkeypatch, cast, poisoned) -> None:
    """Expert parallelism with split-K: foreign pairs add nothing to their tokens' rows (a token whose
    every pair is foreign gets a zero row), local pairs their weighted sum; also with
    QSERVE_MOE_FUSED_CAST=1 (the zero row is its accumulator row, zeroed by gate_up, cast by down)."""
    monkeypatch.setenv(moe_mma.FUSED_CAST_ENV, cast)
    w13, w2 = layer(8, 320, 64, 64, False, torch.float16, seed=91)
    x, weights, ids = routing(7, 8, 2, 320, torch.float16, seed=92)
    ids = torch.randint(0, 8, ids.shape, generator=torch.Generator().manual_seed(93), dtype=torch.int32)
    ids[0] = torch.tensor([0, 1])  # token 0: both pairs on rank 0's experts
    local = moe_reference.local_expert_ids(ids, 4, 4)  # rank 1 of 2
    mine13, mine2 = _rank_share(w13, 1, 2), _rank_share(w2, 1, 2)
    ref = moe_reference.fused_moe_w4a16(x.float(), _as_f32(mine13), _as_f32(mine2), weights, local)
    p13, p2 = moe_mma.prepare_stacked(mine13), moe_mma.prepare_stacked(mine2)
    out = moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, local, moe_mma.MoEMmaConfig(16, 64, split_k=3), True)
    assert_matches(out, ref, torch.float16)
    assert not out[0].any()


def test_split_k_setting(monkeypatch) -> None:
    """``QSERVE_MOE_SPLIT_K``: "auto" for unset / empty / auto (the default), off for 0 / 1, an integer
    >= 2; the rest refused with the variable's name, also at load (``moe_ops.prepare_experts``)."""
    env = moe_mma.SPLIT_K_ENV
    monkeypatch.delenv(env, raising=False)
    assert moe_mma.split_k_setting() == "auto"
    for value, want in (("", "auto"), ("0", 1), ("1", 1), ("auto", "auto"), ("2", 2), (" 8 ", 8)):
        monkeypatch.setenv(env, value)
        assert moe_mma.split_k_setting() == want, value
    for value in ("yes", "-2", "2.5", "Auto", "4x"):
        monkeypatch.setenv(env, value)
        with pytest.raises(ValueError, match=f"QSERVE_MOE_SPLIT_K={value!r}"):
            moe_mma.split_k_setting()
    assert_refused_at_load(monkeypatch, env, good="4 ", bad="on")


def assert_refused_at_load(monkeypatch, env: str, good: str, bad: str) -> None:
    """``moe_ops.prepare_experts`` (the MMA kernel on a simulated sm90) loads with ``env=good`` and
    stops with ``env=bad``, naming the variable and the value: a typo fails the load, not a later step."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_ops

    w13, w2 = layer(4, 128, 64, 64, True, torch.float16, seed=95)
    with mock.patch.object(kdevice, "triton_serves", lambda device: True):
        with mock.patch.object(kdevice, "capability", lambda device: (9, 0)):
            monkeypatch.delenv(moe_ops.MOE_KERNEL_ENV, raising=False)
            monkeypatch.delenv(moe_ops.FUSED_MOE_ENV, raising=False)
            monkeypatch.setenv(env, good)
            assert moe_ops.prepare_experts(w13, w2).kind == "mma"
            monkeypatch.setenv(env, bad)
            with pytest.raises(ValueError, match=f"{env}={bad!r}"):
                moe_ops.prepare_experts(w13, w2)


def test_split_k_selection(monkeypatch) -> None:
    """Off ("0", "1"): the launches without split-K, whatever the batch; "auto" (also unset): Qwen3-30B-A3B's
    decode at 1 and 2 tokens splits (192 / 384 gate_up programs on 132 SMs: 4 and 2), 4+ tokens not
    (>= 768 programs), and never past the down GEMM's 6 K-tiles; N: that split, prefill too."""
    assert moe_mma.default_config(1, 8, 128).split_k == 1
    auto = [moe_mma.default_config(t, 8, 128, "auto", 2048, 768).split_k for t in (1, 2, 4, 8, 32, 512)]
    assert auto == [4, 2, 1, 1, 1, 1]
    assert moe_mma.default_config(1, 8, 128, "auto", 2048, 256).split_k == 2  # down: 2 K-tiles
    assert moe_mma.default_config(512, 8, 128, 8).split_k == 8
    w13, w2 = layer(8, 128, 64, 64, True, torch.float16, seed=97)
    x, weights, ids = routing(1, 8, 2, 128, torch.float16, seed=98)
    p13, p2 = moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2)
    seen = []
    real = moe_mma._split_k_moe
    monkeypatch.setattr(moe_mma, "_split_k_moe", lambda *a: seen.append(a[5].split_k) or real(*a))
    for value in (None, "0", "1", "", "auto", "3"):
        if value is None:
            monkeypatch.delenv(moe_mma.SPLIT_K_ENV, raising=False)
        else:
            monkeypatch.setenv(moe_mma.SPLIT_K_ENV, value)
        moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids)
    assert seen == [3]  # "auto" at this toy layer (I = 64: one K-tile) does not split


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 32, 128, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False])
def test_qwen3_30b_shapes_on_gpu(num_tokens, dtype, sym):
    """Qwen3-30B-A3B's expert shapes (hidden 2048, 128 experts top-8, expert MLP 768, g128), as
    test_moe.py's fused-kernel GPU test, on the MMA-operand kernel; and one rank of 4."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = random_stacked(num_experts, hidden, 2 * inter, 128, sym, dtype, device="cuda", seed=1)
    w2 = random_stacked(num_experts, inter, hidden, 128, sym, dtype, device="cuda", seed=2)
    x, weights, ids = routing(num_tokens, num_experts, top_k, hidden, dtype, seed=num_tokens, device="cuda")
    p13, p2 = moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2)
    rank1 = moe_reference.local_expert_ids(ids, 32, 32)  # experts 32..63 held, the rest foreign
    for held, local, skip in ((slice(None), ids, False), (slice(32, 64), rank1, True)):
        r13, r2 = (_rank_share(w, 1, 4) for w in (w13, w2)) if skip else (w13, w2)
        expected = moe_reference.fused_moe_w4a16(x.float(), _as_f32(r13), _as_f32(r2), weights, local)
        q13, q2 = (dataclasses.replace(p, qweight=p.qweight[held], scales=p.scales[held],
                                       zeros=None if p.zeros is None else p.zeros[held]) for p in (p13, p2))  # fmt: skip
        out = moe_mma.fused_moe_w4a16_mma(x, q13, q2, weights, local, skip_foreign=skip)
        if dtype == torch.float16:
            assert_matches(out, expected, dtype)
        else:  # bf16 roundings of the intermediate and each pair's row: the bound of test_moe.py's GPU test
            error = out.float() - expected
            assert float(error.norm() / expected.norm()) < 1.5e-2
            assert float(error.abs().max()) < 2e-2 * float(expected.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
@pytest.mark.parametrize("split_k", [2, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sym", [True, False])
def test_split_k_qwen3_30b_shapes_on_gpu(num_tokens, split_k, dtype, sym):
    """The split-K launches at Qwen3-30B-A3B's shapes on a GPU (really concurrent programs: the
    arrival counters and the atomic adds, which the interpreter runs one program at a time), against
    the unsplit kernel (same inputs, so the bound is the two roundings' difference), twice in a row,
    and for one rank of 4."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = random_stacked(num_experts, hidden, 2 * inter, 128, sym, dtype, device="cuda", seed=3)
    w2 = random_stacked(num_experts, inter, hidden, 128, sym, dtype, device="cuda", seed=4)
    x, weights, ids = routing(num_tokens, num_experts, top_k, hidden, dtype, seed=num_tokens, device="cuda")
    p13, p2 = moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2)
    rank1 = moe_reference.local_expert_ids(ids, 32, 32)
    for held, local, skip in ((slice(None), ids, False), (slice(32, 64), rank1, True)):
        q13, q2 = (dataclasses.replace(p, qweight=p.qweight[held], scales=p.scales[held],
                                       zeros=None if p.zeros is None else p.zeros[held]) for p in (p13, p2))  # fmt: skip
        plain = moe_mma.fused_moe_w4a16_mma(x, q13, q2, weights, local, moe_mma.MoEMmaConfig(16, 64), skip)
        config = moe_mma.MoEMmaConfig(16, 64, split_k=split_k)
        split = moe_mma.fused_moe_w4a16_mma(x, q13, q2, weights, local, config, skip)
        again = moe_mma.fused_moe_w4a16_mma(x, q13, q2, weights, local, config, skip)
        assert torch.isfinite(split).all()
        error = (split.float() - plain.float()).norm() / plain.float().norm()
        assert float(error) < (1e-2 if dtype == torch.bfloat16 else 2e-3), float(error)
        # the down adds land in any order: equal up to fp32 reassociation, then one rounding
        torch.testing.assert_close(again, split, atol=1e-2 * float(split.abs().max()), rtol=1e-2)
    assert not moe_mma.split_counters(x.device, 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8])
@pytest.mark.parametrize("cast,pdl", [("1", "0"), ("0", "1"), ("1", "1")], ids=["cast", "pdl", "cast-pdl"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_cast_and_pdl_on_gpu(monkeypatch, num_tokens, cast, pdl, dtype):
    """QSERVE_MOE_FUSED_CAST=1 (the down launch casts its own output) and QSERVE_ENABLE_PDL=1 (the split-K
    launches wait for the kernel before; down prefetches its experts' first K-tiles before the wait) at
    Qwen3-30B-A3B's shapes, split 4, really concurrent programs, after the router as the MoE block runs it:
    the plain split-K result within the atomic sums' reassociation, twice in a row, counters left zero.
    (PDL is a no-op below sm90.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from quant_kernels import moe_router_triton

    num_experts, top_k, hidden, inter = 128, 8, 2048, 768
    w13 = random_stacked(num_experts, hidden, 2 * inter, 128, True, dtype, device="cuda", seed=5)
    w2 = random_stacked(num_experts, inter, hidden, 128, True, dtype, device="cuda", seed=6)
    p13, p2 = moe_mma.prepare_stacked(w13), moe_mma.prepare_stacked(w2)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
    router = torch.randn(num_experts, hidden, dtype=dtype, device="cuda") / hidden**0.5
    config = moe_mma.MoEMmaConfig(16, 64, split_k=4)

    def layer_out() -> torch.Tensor:
        routed = moe_router_triton.router_gemm_topk_blocks(x, router, top_k, True, 16)
        weights, ids, sorted_ids, expert_ids, num_padded, _ = routed
        layout = moe_reference.BlockLayout(sorted_ids, expert_ids, num_padded, 16)
        return moe_mma.fused_moe_w4a16_mma(x, p13, p2, weights, ids, config, layout=layout)

    monkeypatch.setenv(moe_mma.FUSED_CAST_ENV, "0")
    monkeypatch.setenv("QSERVE_ENABLE_PDL", "0")
    want = layer_out()
    monkeypatch.setenv(moe_mma.FUSED_CAST_ENV, cast)
    monkeypatch.setenv("QSERVE_ENABLE_PDL", pdl)
    for _ in range(2):
        got = layer_out()
        assert torch.isfinite(got).all() and got.dtype == dtype
        # the down adds land in another order: the fp32 sums may round one ulp of the dtype apart, no more
        ulp = torch.finfo(dtype).eps * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=2 * ulp, rtol=0)
    torch.cuda.synchronize()
    assert not moe_mma.split_counters(x.device, 1 << 10).any()
    assert not moe_router_triton.arrival_counter(x.device).any()


def test_a_misspelt_kernel_choice_is_refused(monkeypatch) -> None:
    """``QSERVE_MOE_KERNEL`` other than ``mma`` or ``fused`` (or unset) stops the load with the variable's name:
    a typo must not quietly run (and get measured as) another kernel."""
    from quant_kernels import device as kdevice
    from quant_kernels import moe_ops

    w13, w2 = layer(4, 128, 64, 64, False, torch.float16, seed=73)
    monkeypatch.setenv(moe_ops.MOE_KERNEL_ENV, "mmma")
    with mock.patch.object(kdevice, "triton_serves", lambda device: True):
        with pytest.raises(ValueError, match="QSERVE_MOE_KERNEL='mmma'.*'fused'"):
            moe_ops.prepare_experts(w13, w2)
