"""Multi-LoRA kernels (``quant_kernels.lora_triton``) against the reference, and the reference
against plain per-row matrix products.

On CPU the kernels run through TRITON_INTERPRET=1 (conftest.py) at small sizes: rows of several
adapters and of the base model interleaved, prefill-like runs longer than a tile, ranks below the
maximum (zero padding), 1 / 2 / 3 output slices of unequal widths. Every case draws fresh random
inputs; the shrink output is NaN-poisoned (base rows must stay NaN: never written) and the expand
updates a copy of the base output whose base rows must come back bit-identical. The shrink runs with
its heuristic K split and with forced splits (workspace partials, arrival counters that must come
back to zero); the interpreter runs programs one after another, so races between splits show only in
the ``gpu`` tests, which run Qwen2.5-14B sizes through ``lora_ops.add_lora`` with the Triton opt-in,
every split override, and a CUDA graph of two LoRA layers replayed for two slot assignments.

Tolerances: kernel and reference both accumulate in fp32 and round at the same points; they differ
by summation order only (plus the interpreter's bf16 truncation), so one or two ulps of the
activation dtype.
"""

from __future__ import annotations

import gc
import itertools
import weakref
from unittest import mock

import numpy as np
import pytest
import torch

from quant_kernels import lora_ops, reference_lora

triton = pytest.importorskip("triton")

from quant_kernels import lora_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float16: (2e-3, 4e-3), torch.bfloat16: (2e-2, 1.6e-2) if CUDA else (4e-2, 3.2e-2)}


def make_case(t: int, k: int, sizes: list[int], num_slots: int, rank: int, dtype, seed: int, base_share=0.3):
    gen = torch.Generator().manual_seed(seed)
    n = sum(sizes)
    x = torch.randn(t, k, generator=gen).to(dtype).to(DEVICE)  # [T, K]
    lora_a = (torch.randn(num_slots, len(sizes) * rank, k, generator=gen) / k**0.5).to(dtype)  # [L, S*R, K]
    lora_b = torch.randn(num_slots, n, rank, generator=gen).to(dtype)  # [L, N, R]
    lora_a[:, rank - 1 :: rank] = 0  # a rank below the maximum: padded rows/columns are zero
    lora_b[..., rank - 1] = 0
    # Slots: runs (prefill segments) and single rows (decode), base rows among them.
    slots = torch.randint(0, num_slots, (t,), generator=gen)
    runs = torch.randint(0, 2, (t,), generator=gen).cumsum(0) % 3 == 0
    slots[runs] = slots[0]
    slots[torch.rand(t, generator=gen) < base_share] = -1
    y = torch.randn(t, n, generator=gen).to(dtype).to(DEVICE)  # the base output
    starts = [0, *np.cumsum(sizes).tolist()]
    return x, lora_a.to(DEVICE), lora_b.to(DEVICE), slots.to(torch.int32).numpy(), y, starts


def shrink(x, lora_a, tiles, num_slices, h, counters, split_k=None, block_k=None):
    """``lora_triton.lora_shrink`` as ``lora_ops.add_lora`` launches it (config from the heuristic, or
    the overrides; a workspace when it splits)."""
    config = lora_triton.shrink_config(
        x.shape[1], x.shape[0], tiles[1].shape[0], num_slices, 132, split_k=split_k, block_k=block_k
    )
    workspace = torch.full((config.split_k, *h.shape), float("nan"), dtype=torch.float32, device=DEVICE)
    return lora_triton.lora_shrink(x, lora_a, *tiles, num_slices, h, config, workspace, counters), config


def run_case(
    t, k, sizes, num_slots, rank, dtype, seed, pad_tiles: int = 0, split_k=None, block_k=None, block_n=None
) -> None:
    x, lora_a, lora_b, slots, y, starts = make_case(t, k, sizes, num_slots, rank, dtype, seed)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    mask = torch.from_numpy(slots >= 0).to(DEVICE)
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    counters = indices.tile_counters
    if pad_tiles:  # a CUDA graph's fixed tile count: empty tiles (length 0) after the real ones
        pad = torch.zeros(pad_tiles, dtype=torch.int32, device=DEVICE)
        tiles = (tiles[0], *(torch.cat([tile, pad]) for tile in tiles[1:]))
        counters = torch.zeros(tiles[1].numel() * lora_ops.MAX_SLICES, dtype=torch.int32, device=DEVICE)
    h = torch.full((t, lora_a.shape[1]), float("nan"), dtype=dtype, device=DEVICE)
    _, config = shrink(x, lora_a, tiles, len(sizes), h, counters, split_k, block_k)
    if split_k is not None:
        assert config.split_k > 1, "the case meant to split K does not"
    assert not counters.any(), "the split-K arrival counters were not left at zero"
    h_ref = reference_lora.lora_shrink(x, lora_a, indices.token_slots, torch.full_like(h, float("nan")))
    assert torch.isnan(h[~mask]).all(), "base rows of the shrink output were written"
    assert not torch.isnan(h[mask]).any(), "rows with an adapter were not written"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(h[mask].float(), h_ref[mask].float(), atol=atol, rtol=rtol)
    out = lora_triton.lora_expand(y.clone(), h_ref, lora_b, *tiles, starts, block_n or lora_triton.EXPAND_BLOCK_N)
    ref = reference_lora.lora_expand(y.clone(), h_ref, lora_b, indices.token_slots, starts)
    assert torch.equal(out[~mask], y[~mask]), "base rows of the output changed"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "t,k,sizes,num_slots,rank",
    [
        (1, 40, [48], 1, 8),  # batch-1 decode, K not a multiple of the K block
        (7, 64, [32, 16, 16], 3, 8),  # qkv: three slices, decode rows of three adapters
        (37, 72, [40, 40], 4, 16),  # gate_up: prefill runs longer than a tile
        (20, 96, [70], 2, 24),  # rank not a power of two, N past one N block
    ],
)
def test_kernels_match_reference(t, k, sizes, num_slots, rank, dtype) -> None:
    run_case(t, k, sizes, num_slots, rank, dtype, seed=t * 100 + k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "t,k,sizes,num_slots,rank,split_k,block_k",
    [
        (1, 100, [48], 1, 8, 7, 16),  # 7 splits of 16 (SPLIT_PAD 8), the last one a 4-column tail
        (9, 72, [32, 16, 16], 3, 8, 3, 16),  # qkv: 3 splits of 32 (K blocks 5: the last split is short)
        (37, 130, [40, 40], 4, 16, 2, 64),  # prefill runs past a tile, 2 splits, a 2-column tail
        (20, 96, [70], 2, 24, 32, 16),  # more splits asked for than K blocks: 6 of 16
    ],
)
def test_split_k_shrink_matches_reference(t, k, sizes, num_slots, rank, split_k, block_k, dtype) -> None:
    """Split-K (partials in a workspace, the last program of a tile-slice sums them): the same ``h``
    as the reference within the one-split tolerance, counters back at zero, base rows unwritten."""
    run_case(t, k, sizes, num_slots, rank, dtype, seed=t * 100 + k + split_k, split_k=split_k, block_k=block_k)


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_empty_padding_tiles_do_nothing(dtype) -> None:
    run_case(11, 48, [32, 16], 3, 8, dtype, seed=5, pad_tiles=4)
    run_case(11, 48, [32, 16], 3, 8, dtype, seed=6, pad_tiles=4, split_k=3, block_k=16)


@pytest.mark.parametrize("block_n", [128, 256])
@pytest.mark.parametrize(
    "t,k,sizes,num_slots,rank",
    [
        (7, 64, [300, 40, 40], 3, 8),  # qkv: a slice past one 256 block, two narrower than one
        (20, 96, [70], 2, 24),  # one slice narrower than the block
    ],
)
def test_wide_expand_blocks_match_reference(t, k, sizes, num_slots, rank, block_n) -> None:
    """QSERVE_LORA_EXPAND_BLOCK_N's wider blocks (128, 256; "auto" picks 256 for the widest grids): the
    expand equals the reference, base rows untouched, padding tiles idle, masked slice tails."""
    run_case(t, k, sizes, num_slots, rank, torch.float16, seed=t + block_n, pad_tiles=3, block_n=block_n)


def test_expand_block_n_rule_and_setting(monkeypatch) -> None:
    """``expand_block_n``: 256 only where 64-column blocks would launch more than WIDE_EXPAND_PROGRAMS
    programs (Qwen2.5-14B's gate_up in a batch-32 decode graph with 32 slots, 34 tiles), else 64 (its qkv
    there, any batch-1 graph); the setting: unset is "auto" (the default since the H200 smoke with it
    exported, 2026-12-07), bad values are refused by name."""
    gate_up, qkv = (0, 13824, 27648), (0, 5120, 6144, 7168)
    graph_tiles = lora_ops.max_lora_tiles(32, 32)
    assert graph_tiles == 34
    assert lora_triton.expand_block_n(graph_tiles, gate_up) == 256
    assert lora_triton.expand_block_n(graph_tiles, qkv) == 64
    assert lora_triton.expand_block_n(lora_ops.max_lora_tiles(1, 32), gate_up) == 64
    with pytest.raises(ValueError, match="block_n"):
        lora_triton.expand_geometry(qkv, 32)
    monkeypatch.delenv(lora_ops.EXPAND_BLOCK_N_ENV, raising=False)
    assert lora_ops.expand_block_n_setting() == "auto"
    for value in ("64", "128", "256", "auto"):
        monkeypatch.setenv(lora_ops.EXPAND_BLOCK_N_ENV, value)
        assert lora_ops.expand_block_n_setting() == value
    for bad in ("32", "512", "wide", "1"):
        monkeypatch.setenv(lora_ops.EXPAND_BLOCK_N_ENV, bad)
        with pytest.raises(ValueError, match=lora_ops.EXPAND_BLOCK_N_ENV):
            lora_ops.expand_block_n_setting()


def test_add_lora_launches_the_expand_block_the_setting_asks_for(monkeypatch) -> None:
    """``add_lora`` hands the expand the setting's N block ("auto", also when unset: the rule for the
    step's tile count)."""
    seen = []
    real = lora_triton.lora_expand
    monkeypatch.setattr(lora_triton, "lora_expand", lambda *a: seen.append(a[-1]) or real(*a))
    monkeypatch.setattr(lora_ops.kdevice, "triton_serves", lambda device: True)  # the interpreter stands in
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    x, lora_a, lora_b, slots, y, starts = make_case(5, 32, [40, 8], 2, 8, torch.float16, seed=3)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    monkeypatch.setattr(lora_triton, "WIDE_EXPAND_PROGRAMS", 1)  # any grid counts as wide
    lora_triton.expand_block_n.cache_clear()
    try:
        for value, want in ((None, 256), ("64", 64), ("128", 128), ("auto", 256)):  # unset: "auto"
            if value is None:
                monkeypatch.delenv(lora_ops.EXPAND_BLOCK_N_ENV, raising=False)
            else:
                monkeypatch.setenv(lora_ops.EXPAND_BLOCK_N_ENV, value)
            want_y = reference_lora.lora_expand(
                y.clone(),
                reference_lora.lora_shrink(x, lora_a, indices.token_slots, torch.empty(5, 16, dtype=x.dtype)),
                lora_b,
                indices.token_slots,
                starts,
            )
            got = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices)
            assert seen[-1] == want, value
            torch.testing.assert_close(got.float(), want_y.float(), atol=4e-3, rtol=4e-3)
    finally:
        lora_triton.expand_block_n.cache_clear()


def test_split_k_is_deterministic_and_counters_are_reused() -> None:
    """Two layers' shrinks share one counter array (as a step's layers do): the second launch finds
    them at zero; the same inputs give bit-identical ``h`` (the reduction order is fixed)."""
    x, lora_a, _, slots, _, _ = make_case(13, 80, [16, 16], 3, 8, torch.float16, seed=9)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    outs = []
    for _ in range(2):
        h = torch.zeros(13, lora_a.shape[1], dtype=torch.float16, device=DEVICE)
        shrink(x, lora_a, tiles, 2, h, indices.tile_counters, split_k=5, block_k=16)
        assert not indices.tile_counters.any()
        outs.append(h)
    assert torch.equal(outs[0], outs[1])


def test_shrink_config_heuristic() -> None:
    """Decode fills 132 SMs with at least 2 K blocks a split; a long prefill splits little; every
    config covers K exactly once in whole blocks; bad overrides are refused."""
    config = lora_triton.shrink_config
    assert config(5120, 1, 1, 3, 132).split_k == 20  # qkv at batch 1: 60 programs of 256 columns
    assert config(13824, 32, 2, 1, 132).split_k == 27  # down: 27 splits of 512 (capped at 32)
    assert config(5120, 32, 34, 3, 132).split_k == 20  # a graph's padded tiles don't shrink the split
    assert config(5120, 2048, 132, 3, 132).split_k == 2  # a 2048-row prefill: 792 programs
    assert config(5120, 8192, 520, 3, 132).split_k == 1
    assert config(64, 1, 1, 1, 132).split_k == 1  # K of one block: nothing to split
    for k in (40, 100, 5120, 13824):
        for rows, tiles, slices in ((1, 1, 3), (32, 10, 2), (128, 40, 1), (2048, 140, 3)):
            c = config(k, rows, tiles, slices, 82)
            assert c.k_per_split % c.block_k == 0
            assert (c.split_k - 1) * c.k_per_split < k <= c.split_k * c.k_per_split
            assert 1 <= c.split_k <= lora_triton.MAX_SPLIT_K
    assert config(5120, 1, 1, 1, 132, split_k=4, block_k=64) == lora_triton.ShrinkConfig(4, 64, 1280)
    with pytest.raises(ValueError, match="split_k"):
        config(5120, 1, 1, 1, 132, split_k=0)
    with pytest.raises(ValueError, match="block_k"):
        config(5120, 1, 1, 1, 132, block_k=48)


def test_shrink_refuses_a_short_workspace_or_counters() -> None:
    x, lora_a, _, slots, _, _ = make_case(5, 64, [16], 2, 8, torch.float16, seed=1)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    h = torch.zeros(5, 8, dtype=torch.float16, device=DEVICE)
    config = lora_triton.shrink_config(64, 5, tiles[1].numel(), 1, 132, split_k=2, block_k=16)
    with pytest.raises(ValueError, match="workspace"):
        lora_triton.lora_shrink(x, lora_a, *tiles, 1, h, config, torch.zeros(1, 5, 8), indices.tile_counters)
    with pytest.raises(ValueError, match="counters"):
        lora_triton.lora_shrink(
            x, lora_a, *tiles, 1, h, config, torch.zeros(2, 5, 8), torch.zeros(1, dtype=torch.int32)
        )


def test_reference_is_per_row_matmul() -> None:
    """The reference is ``y + (x @ A[slot]^T) @ B[slot]^T`` row by row (fp32, no rounding in between)."""
    x, lora_a, lora_b, slots, y, starts = make_case(9, 24, [16, 8], 3, 4, torch.float32, seed=3)
    x, lora_a, lora_b, y = x.cpu(), lora_a.cpu(), lora_b.cpu(), y.cpu()
    indices = lora_ops.build_lora_indices(slots, torch.device("cpu"))
    out = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices)
    for row, slot in enumerate(slots.tolist()):
        want = y[row].clone()
        if slot >= 0:
            for s in range(2):
                a = lora_a[slot, s * 4 : (s + 1) * 4]  # [R, K]
                b = lora_b[slot, starts[s] : starts[s + 1]]  # [N_s, R]
                want[starts[s] : starts[s + 1]] += b @ (a @ x[row])
        torch.testing.assert_close(out[row], want, atol=1e-5, rtol=1e-5)


def test_tiles_group_rows_by_slot() -> None:
    slots = np.array([2, -1, 0, 2, 2, -1, 0] + [1] * 18, dtype=np.int32)
    ind = lora_ops.build_lora_indices(slots, torch.device("cpu"))
    assert ind.token_slots.tolist() == slots.tolist()
    assert ind.sorted_rows.tolist() == [2, 6] + list(range(7, 25)) + [0, 3, 4]
    assert ind.tile_slots.tolist() == [0, 1, 1, 2]
    assert ind.tile_offsets.tolist() == [0, 2, 18, 20] and ind.tile_lens.tolist() == [2, 16, 2, 3]
    assert ind.tile_counters.tolist() == [0] * 4 * lora_ops.MAX_SLICES
    empty = lora_ops.build_lora_indices(np.full(4, -1, dtype=np.int32), torch.device("cpu"))
    assert empty.tile_offsets.numel() == 0 and empty.sorted_rows.numel() == 0


def test_indices_are_aligned_views_of_one_buffer() -> None:
    """One host-to-device copy a step: every array a view of one buffer, each 16-byte aligned (a
    misaligned pointer would compile another kernel variant mid-serving)."""
    for n in (1, 3, 7, 25):
        slots = np.arange(n, dtype=np.int32) % 3 - 1
        ind = lora_ops.build_lora_indices(slots, torch.device("cpu"))
        host_side = ("plans", "overlap")
        tensors = [getattr(ind, f) for f in ind.__dataclass_fields__ if f not in host_side]
        base = ind.token_slots.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in tensors)
        assert all(t.storage_offset() % 4 == 0 for t in tensors)


def test_graph_layout_pads_rows_and_tiles() -> None:
    """A decode graph's indices (``fill_index_buffer`` then ``indices_from_buffer`` for a bucket):
    the step's tiles as ``build_lora_indices`` makes them, then empty tiles; pad rows of slot -1;
    counters zero; a stale buffer (a bigger bucket's step before) is overwritten."""
    bucket, max_loras = 8, 4
    tiles = lora_ops.max_lora_tiles(bucket, max_loras)
    total, _ = lora_ops.index_layout(bucket, tiles)
    host = np.full(total + 8, 77, dtype=np.int32)  # stale contents
    step = np.array([2, -1, 0, 2, 0], dtype=np.int32)  # 5 rows padded to the bucket of 8
    lora_ops.fill_index_buffer(host, step, bucket, tiles)
    got = lora_ops.indices_from_buffer(torch.from_numpy(host), bucket, tiles)
    want = lora_ops.build_lora_indices(step, torch.device("cpu"))
    assert got.token_slots.tolist() == step.tolist() + [-1] * 3
    assert got.sorted_rows[: want.sorted_rows.numel()].tolist() == want.sorted_rows.tolist()
    real = want.tile_offsets.numel()
    for field in ("tile_offsets", "tile_lens", "tile_slots"):
        assert getattr(got, field)[:real].tolist() == getattr(want, field).tolist()
    assert got.tile_lens[real:].tolist() == [0] * (tiles - real)
    assert got.tile_counters.tolist() == [0] * tiles * lora_ops.MAX_SLICES
    with pytest.raises(ValueError, match="tiles"):
        lora_ops.fill_index_buffer(host, np.arange(bucket, dtype=np.int32), bucket, 2)
    # The kernels on these views (split K): the reference's output, pad and base rows untouched.
    x, lora_a, lora_b, _, y, starts = make_case(bucket, 64, [16, 8], 3, 8, torch.float16, seed=2)
    got = lora_ops.indices_from_buffer(torch.from_numpy(host).to(DEVICE), bucket, tiles)
    views = (got.sorted_rows, got.tile_offsets, got.tile_lens, got.tile_slots)
    h = torch.zeros(bucket, lora_a.shape[1], dtype=torch.float16, device=DEVICE)
    shrink(x, lora_a, views, 2, h, got.tile_counters, split_k=4, block_k=16)
    out = lora_triton.lora_expand(y.clone(), h, lora_b, *views, starts)
    ref = reference_lora.lora_expand(
        y.clone(), reference_lora.lora_shrink(x, lora_a, got.token_slots, h.clone()), lora_b, got.token_slots, starts
    )
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=4e-3)
    assert torch.equal(out[got.token_slots < 0], y[got.token_slots < 0])


def test_dispatch_is_reference_off_cuda(monkeypatch) -> None:
    """Off CUDA (and on CUDA without the opt-in) ``add_lora`` is the reference, bit for bit."""
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    x, lora_a, lora_b, slots, y, starts = make_case(5, 32, [16], 2, 8, torch.float16, seed=4)
    x, lora_a, lora_b, y = x.cpu(), lora_a.cpu(), lora_b.cpu(), y.cpu()
    indices = lora_ops.build_lora_indices(slots, torch.device("cpu"))
    got = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices)
    h = reference_lora.lora_shrink(x, lora_a, indices.token_slots, torch.zeros(5, 8, dtype=torch.float16))
    assert torch.equal(got, reference_lora.lora_expand(y.clone(), h, lora_b, indices.token_slots, starts))


# ----------------------------------------------------------------------------------------------
# GPU: Qwen2.5-14B sizes (H=5120, qkv 5120+1024+1024, gate_up 2x13824), 8 adapters of rank 16
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 8, 32, 128, 300, 2048])
@pytest.mark.parametrize("k,sizes", [(5120, [5120, 1024, 1024]), (5120, [13824, 13824]), (13824, [5120])])
def test_gpu_real_sizes(monkeypatch, t, k, sizes) -> None:
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    x, lora_a, lora_b, slots, y, starts = make_case(t, k, sizes, 8, 16, torch.float16, seed=t)
    indices = lora_ops.build_lora_indices(slots, torch.device("cuda"))
    got = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices)
    h = reference_lora.lora_shrink(
        x, lora_a, indices.token_slots, torch.zeros(t, lora_a.shape[1], dtype=x.dtype, device="cuda")
    )
    want = reference_lora.lora_expand(y.clone(), h, lora_b, indices.token_slots, starts)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("split_k", [1, 2, 7, 32])
@pytest.mark.parametrize("k,sizes", [(5120, [5120, 1024, 1024]), (13824, [5120])])
def test_gpu_split_k_overrides(monkeypatch, split_k, k, sizes) -> None:
    """Every split (the tuning overrides bench/lora.py sweeps) gives the reference's output; the
    counters come back to zero with programs really racing; the same inputs give the same bits."""
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    x, lora_a, lora_b, slots, y, starts = make_case(32, k, sizes, 8, 16, torch.float16, seed=split_k)
    indices = lora_ops.build_lora_indices(slots, torch.device("cuda"))
    h = reference_lora.lora_shrink(
        x, lora_a, indices.token_slots, torch.zeros(32, lora_a.shape[1], dtype=x.dtype, device="cuda")
    )
    want = reference_lora.lora_expand(y.clone(), h, lora_b, indices.token_slots, starts)
    runs = [lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices, split_k=split_k) for _ in range(3)]
    assert not indices.tile_counters.any()
    torch.testing.assert_close(runs[0].float(), want.float(), atol=2e-2, rtol=1e-2)
    assert all(torch.equal(runs[0], run) for run in runs[1:]), "split-K results vary from run to run"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_add_lora_in_a_cuda_graph(monkeypatch) -> None:
    """Two LoRA layers of a decode step (qkv, then down) captured in one CUDA graph with a graph's
    padded indices (one int32 buffer, ``fill_index_buffer``) and replayed for two different slot
    assignments: each replay gives the reference's output (the split-K counters are reused by both
    layers and every replay; the workspace lives in the graph's pool), also for a step of fewer rows
    than the graph's batch."""
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    batch, max_loras = 32, 8
    tiles = lora_ops.max_lora_tiles(batch, max_loras)
    total, _ = lora_ops.index_layout(batch, tiles)
    buffer = torch.zeros(total, dtype=torch.int32, device="cuda")
    indices = lora_ops.indices_from_buffer(buffer, batch, tiles)
    layers = []
    for k, sizes in ((5120, [5120, 1024, 1024]), (13824, [5120])):
        x, lora_a, lora_b, _, y, starts = make_case(batch, k, sizes, max_loras, 16, torch.float16, seed=k)
        layers.append((x, lora_a, lora_b, y, torch.empty_like(y), starts))

    def step() -> None:
        for x, lora_a, lora_b, y0, y, starts in layers:
            y.copy_(y0)
            lora_ops.add_lora(y, x, lora_a, lora_b, starts, indices)

    host = np.zeros(total, dtype=np.int32)
    lora_ops.fill_index_buffer(host, np.full(batch, -1, dtype=np.int32), batch, tiles)
    buffer.copy_(torch.from_numpy(host))
    step()  # warm-up: compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = np.random.default_rng(0)
    # the last: a step of fewer rows than the graph's batch (its pad rows take no slot)
    for step_slots in (
        gen.integers(-1, max_loras, batch),
        np.arange(batch) % 3 - 1,
        gen.integers(0, max_loras, batch - 5),
    ):
        lora_ops.fill_index_buffer(host, step_slots.astype(np.int32), batch, tiles)
        buffer.copy_(torch.from_numpy(host))
        graph.replay()
        torch.cuda.synchronize()
        assert not indices.tile_counters.any()
        for x, lora_a, lora_b, y0, y, starts in layers:
            h = torch.zeros(batch, lora_a.shape[1], dtype=x.dtype, device="cuda")
            h = reference_lora.lora_shrink(x, lora_a, indices.token_slots, h)
            want = reference_lora.lora_expand(y0.clone(), h, lora_b, indices.token_slots, starts)
            torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=1e-2)


# ----------------------------------------------------------------------------------------------
# Host work per call (issue 30): the launch plans add_lora reuses, and the plain-Python geometry
# ----------------------------------------------------------------------------------------------


def _cpu_triton_branch(monkeypatch) -> None:
    """lora_ops' Triton branch on CPU tensors (the kernels run in the interpreter)."""
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    monkeypatch.setattr(lora_ops.kdevice, "triton_serves", lambda device: True)


def test_add_lora_reuses_its_plan_per_shape_and_matches_reference(monkeypatch) -> None:
    """A second call at the same shape reuses the plan (config, workspace, h) and still gives the
    reference's output on new inputs; another row count, tile count or layer width gets its own."""
    _cpu_triton_branch(monkeypatch)
    cases = [make_case(t, 256, sizes, 3, 8, torch.float16, seed=seed) for t, sizes, seed in
             ((7, [32, 16, 16], 0), (7, [32, 16, 16], 1), (9, [32, 16, 16], 0), (7, [48], 0))]  # fmt: skip
    plans = []
    first_indices = lora_ops.build_lora_indices(cases[0][3], torch.device("cpu"))
    for i, (x, lora_a, lora_b, slots, y, starts) in enumerate(cases):
        # the second: new inputs, the first's rows and tiles (the same step, the next layer)
        indices = first_indices if i < 2 else lora_ops.build_lora_indices(slots, torch.device("cpu"))
        got = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices, split_k=2)
        h = reference_lora.lora_shrink(x, lora_a, indices.token_slots, torch.zeros(len(slots), lora_a.shape[1]))
        want = reference_lora.lora_expand(y.clone(), h.to(x.dtype), lora_b, indices.token_slots, starts)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=4e-3)
        plans.append(lora_ops._launch_plan(x, lora_a, len(starts) - 1, indices, 2, None))
    assert plans[0].config.split_k == 2, "the case meant to use the workspace does not"
    assert plans[0] is plans[1], "the same shape did not reuse its plan"
    assert plans[2] is not plans[0] and plans[2].h.shape[0] == 9, "another row count shared a plan"
    assert plans[3] is not plans[0] and plans[3].h.shape[1] == 8, "another layer width shared a plan"
    for a, b in ((0, 2), (0, 3), (2, 3)):
        assert plans[a].h.data_ptr() != plans[b].h.data_ptr(), "two live plans share an h buffer"
        assert plans[a].workspace.data_ptr() != plans[b].workspace.data_ptr(), "two live plans share a workspace"


def test_lora_shrink_returns_its_own_h_and_plans_are_per_step(monkeypatch) -> None:
    """``lora_shrink``'s ``h`` belongs to its caller (a row-parallel layer holds it across an
    all-reduce): two calls never return the same buffer, nor add_lora's. Another step's indices
    (the next step, or another engine's) get their own plans."""
    _cpu_triton_branch(monkeypatch)
    x, lora_a, lora_b, slots, y, starts = make_case(7, 64, [32, 16, 16], 3, 8, torch.float16, seed=1)
    indices = lora_ops.build_lora_indices(slots, torch.device("cpu"))
    first = lora_ops.lora_shrink(x, lora_a, 3, indices)
    second = lora_ops.lora_shrink(x, lora_a, 3, indices)
    lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, indices)
    plan = lora_ops._launch_plan(x, lora_a, 3, indices, None, None)
    assert len({first.data_ptr(), second.data_ptr(), plan.h.data_ptr()}) == 3
    rows = indices.token_slots >= 0
    torch.testing.assert_close(first[rows], second[rows], atol=0, rtol=0)
    next_step = lora_ops.build_lora_indices(slots, torch.device("cpu"))
    other = lora_ops._launch_plan(x, lora_a, 3, next_step, None, None)
    assert other is not plan and other.h.data_ptr() != plan.h.data_ptr()
    assert list(indices.plans.values()) == [plan] and list(next_step.plans.values()) == [other]


def test_plans_are_skipped_in_graph_capture(monkeypatch) -> None:
    """Inside a CUDA-graph capture every call gets fresh buffers (the graph's pool keeps them) and
    the indices keep no plan: a graph's indices outlive the capture, and nothing eager may ever
    write into memory a graph replays into."""
    _cpu_triton_branch(monkeypatch)
    lora_a = torch.zeros(2, 16, 32, dtype=torch.float16)
    x = torch.zeros(3, 32, dtype=torch.float16)
    indices = lora_ops.build_lora_indices(np.zeros(3, dtype=np.int32), torch.device("cpu"))
    cached = lora_ops._launch_plan(x, lora_a, 1, indices, None, None)
    assert lora_ops._launch_plan(x, lora_a, 1, indices, None, None) is cached
    fake_cuda = mock.Mock(wraps=x)
    fake_cuda.device = torch.device("cuda", 0)
    fake_cuda.shape, fake_cuda.dtype = x.shape, x.dtype
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(lora_ops.kdevice, "sm_count", lambda device, default: 132)
    monkeypatch.setattr(torch, "empty", lambda *a, **k: torch.zeros(*a, **{**k, "device": "cpu"}))
    monkeypatch.setattr(lora_ops.kdevice, "placeholder", lambda device, dtype: torch.zeros(1, dtype=dtype))
    graph_indices = lora_ops.build_lora_indices(np.zeros(3, dtype=np.int32), torch.device("cpu"))
    captured = [lora_ops._launch_plan(fake_cuda, lora_a, 1, graph_indices, None, None) for _ in range(2)]
    assert captured[0] is not captured[1] and captured[0].h.data_ptr() != captured[1].h.data_ptr()
    assert not graph_indices.plans
    assert all(p.config == cached.config for p in captured)


def test_host_geometry_matches_triton_helpers() -> None:
    """The plain-Python powers of two and expand geometry equal what ``triton.cdiv`` /
    ``triton.next_power_of_2`` gave (the launch's constexprs and grid must not change)."""
    for n in range(1, 300):
        assert lora_triton._next_power_of_2(n) == triton.next_power_of_2(n)
    cases = ([0, 5120, 6144, 7168], [0, 13824, 27648], [0, 5120], [0, 70], [0, 1, 2])
    for starts, block_n in itertools.product(cases, lora_triton.EXPAND_BLOCK_NS):
        blocks = [triton.cdiv(b - a, block_n) for a, b in zip(starts, starts[1:])]
        bounds, total, first1, first2 = lora_triton.expand_geometry(tuple(starts), block_n)
        assert bounds == tuple(starts) + (starts[-1],) * (4 - len(starts)) and total == sum(blocks)
        assert first1 == (blocks[0] if len(blocks) > 1 else total)
        assert first2 == (sum(blocks[:2]) if len(blocks) > 2 else total)
    with pytest.raises(ValueError, match="output slices"):
        lora_triton.expand_geometry((0, 1, 2, 3, 4))


# ----------------------------------------------------------------------------------------------
# QSERVE_LORA_OVERLAP: the shrink (and with "pair" the expand) on a side stream beside the base GEMM
# ----------------------------------------------------------------------------------------------


def test_overlap_only_on_cuda_and_only_when_asked(monkeypatch) -> None:
    monkeypatch.delenv(lora_ops.OVERLAP_ENV, raising=False)
    assert lora_ops.overlap_for(torch.device("cpu")) is None
    for mode in ("0", "shrink", "pair"):
        monkeypatch.setenv(lora_ops.OVERLAP_ENV, mode)
        assert lora_ops.overlap_for(torch.device("cpu")) is None  # no stream off CUDA: add_lora's order
    monkeypatch.setenv(lora_ops.OVERLAP_ENV, "")  # empty: unset
    assert lora_ops.overlap_for(torch.device("cpu")) is None
    for bad in ("1", "yes", "both"):
        monkeypatch.setenv(lora_ops.OVERLAP_ENV, bad)
        with pytest.raises(ValueError, match=lora_ops.OVERLAP_ENV):
            lora_ops.overlap_for(torch.device("cpu"))


def test_overlap_is_the_side_shrink_by_default_on_cuda(monkeypatch) -> None:
    """On a CUDA device (a stand-in stream here) unset means "shrink" (measured faster in every row of the
    H100 run of 2026-12-07, bench/RESULTS.md); "0" turns it off; QSERVE_LORA_SIDE_SPLIT_K sets the side
    shrink's K split (unset or empty: 4; "auto": the heuristic's) and a bad value is refused by name,
    whether or not the overlap is on."""
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: ("side", device))
    cuda = torch.device("cuda")
    for env in (lora_ops.OVERLAP_ENV, lora_ops.SIDE_SPLIT_K_ENV):
        monkeypatch.delenv(env, raising=False)
    # unset: the side split 4 (the default since the H200 smoke with it exported, 2026-12-07)
    assert lora_ops.overlap_for(cuda) == lora_ops.LoRAOverlap(("side", cuda), pair=False, split_k=4)
    monkeypatch.setenv(lora_ops.OVERLAP_ENV, "0")
    assert lora_ops.overlap_for(cuda) is None
    monkeypatch.setenv(lora_ops.OVERLAP_ENV, "pair")
    for value, want in (("auto", None), ("", 4), ("4", 4), ("8", 8), ("32", 32)):
        monkeypatch.setenv(lora_ops.SIDE_SPLIT_K_ENV, value)
        assert lora_ops.overlap_for(cuda) == lora_ops.LoRAOverlap(("side", cuda), pair=True, split_k=want)
    for mode in ("0", "pair"):
        monkeypatch.setenv(lora_ops.OVERLAP_ENV, mode)
        for bad in ("0", "33", "four", "-2"):
            monkeypatch.setenv(lora_ops.SIDE_SPLIT_K_ENV, bad)
            with pytest.raises(ValueError, match=lora_ops.SIDE_SPLIT_K_ENV):
                lora_ops.overlap_for(cuda)
    assert lora_ops._MAX_SPLIT_K == lora_triton.MAX_SPLIT_K


class _RecordingStream:
    """A stand-in for torch.cuda.Stream that logs the fork / join calls made on it (and on the
    current stream) into one shared log."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _RecordingStream) -> None:
        self.log.append(f"{self.name} waits {other.name}")


def _record_streams(monkeypatch, log: list) -> tuple[_RecordingStream, _RecordingStream]:
    """(main, side) recording streams standing in for torch.cuda's current stream and a side stream;
    every shrink, expand and in-place add of a tensor is logged with the stream it was launched on."""
    main, side = _RecordingStream("main", log), _RecordingStream("side", log)
    current = [main]

    class _On:
        def __init__(self, stream) -> None:  # noqa: ANN001
            self.stream = stream

        def __enter__(self) -> None:
            current.append(self.stream)

        def __exit__(self, *exc: object) -> None:
            current.pop()

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", _On)
    lora_triton = lora_ops._lora_triton()
    for name in ("lora_shrink", "lora_expand"):
        launch = getattr(lora_triton, name)

        def spy(*args, _launch=launch, _name=name):  # noqa: ANN002, ANN202
            log.append(f"{_name} into {args[0 if _name == 'lora_expand' else 7].dtype} on {current[-1].name}")
            return _launch(*args)

        monkeypatch.setattr(lora_triton, name, spy)
    return main, side


@pytest.mark.parametrize("pair", [False, True], ids=["shrink", "pair"])
def test_begin_finish_lora_order_and_outputs(monkeypatch, pair) -> None:
    """With an overlap in the indices, ``begin_lora`` forks the side stream from the current one and
    launches the shrink on it ("pair": and the expand, into an fp32 delta), ``finish_lora`` joins it
    back, then expands into y ("pair": adds the delta): the launches in that order (kernels in the
    interpreter, the streams recorded), and the output add_lora's, bitwise (also "pair" here: the
    interpreter adds y after the dot, where a GPU's MMA accumulates onto it). Past PAIR_MAX_ROWS rows a
    "pair" call overlaps the shrink only. Without an overlap both halves run in order."""
    _cpu_triton_branch(monkeypatch)
    x, lora_a, lora_b, slots, y, starts = make_case(9, 256, [32, 16, 16], 3, 8, torch.float16, seed=3)
    want = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, lora_ops.build_lora_indices(slots, x.device))
    log: list[str] = []
    _, side = _record_streams(monkeypatch, log)
    indices = lora_ops.build_lora_indices(slots, x.device, lora_ops.LoRAOverlap(side, pair))
    pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
    log.append("base GEMM on main")
    got = lora_ops.finish_lora(y.clone(), pending, lora_b, starts, indices)
    expand = ["lora_expand into torch.float32 on side"] if pair else []
    finish = [] if pair else ["lora_expand into torch.float16 on main"]
    shrink = "lora_shrink into torch.float16 on side"
    assert log == ["side waits main", shrink, *expand, "base GEMM on main", "main waits side", *finish]
    assert torch.equal(got, want)
    assert (pending.delta is not None) == pair

    log.clear()
    monkeypatch.setattr(lora_ops, "PAIR_MAX_ROWS", 8)  # 9 rows: past it
    pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
    assert pending.delta is None and log == ["side waits main", shrink]
    assert torch.equal(lora_ops.finish_lora(y.clone(), pending, lora_b, starts, indices), want)

    monkeypatch.setattr(lora_ops.kdevice, "triton_serves", lambda device: False)  # off CUDA: the reference
    plain = lora_ops.build_lora_indices(slots, x.device)
    got = lora_ops.finish_lora(y.clone(), lora_ops.begin_lora(x, lora_a, lora_b, starts, plain), lora_b, starts, plain)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=4e-3)


def test_side_shrink_takes_the_overlaps_k_split(monkeypatch) -> None:
    """``QSERVE_LORA_SIDE_SPLIT_K`` (``LoRAOverlap.split_k``): the side stream's shrink launches with that
    split, not the heuristic's (which ``add_lora`` in order keeps), and the output is the reference's."""
    _cpu_triton_branch(monkeypatch)
    x, lora_a, lora_b, slots, y, starts = make_case(9, 256, [32, 16, 16], 3, 8, torch.float16, seed=4)
    want = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, lora_ops.build_lora_indices(slots, x.device))
    _, side = _record_streams(monkeypatch, [])
    lora_triton = lora_ops._lora_triton()
    splits = []
    launch = lora_triton.lora_shrink
    monkeypatch.setattr(lora_triton, "lora_shrink", lambda *a: splits.append(a[8].split_k) or launch(*a))
    heuristic = lora_triton.shrink_config(256, 9, 3, 3, 132).split_k
    for side_split in (None, 4):
        indices = lora_ops.build_lora_indices(slots, x.device, lora_ops.LoRAOverlap(side, False, side_split))
        pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
        got = lora_ops.finish_lora(y.clone(), pending, lora_b, starts, indices)
        assert splits[-1] == (heuristic if side_split is None else side_split)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=4e-3)
    assert heuristic != 4


class _NoPlanCache(dict):
    """``LoRAIndices.plans`` as inside a CUDA-graph capture: every plan is made fresh, none kept."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


@pytest.mark.parametrize("pair", [False, True], ids=["shrink", "pair"])
def test_begin_lora_holds_what_the_side_stream_writes_until_the_join(monkeypatch, pair) -> None:
    """Every tensor a side-stream launch writes (h, the split-K workspace, "pair"'s delta) stays alive
    until ``finish_lora``: freed at ``begin_lora``'s return, its memory goes to the current stream's next
    allocation while the side stream still writes it. Inside a CUDA-graph capture (plans not cached) the
    workspace was freed so: the overlap's graph test failed on the first H100 smoke, eager passed."""
    _cpu_triton_branch(monkeypatch)
    x, lora_a, lora_b, slots, y, starts = make_case(9, 256, [32, 16, 16], 3, 8, torch.float16, seed=3)
    want = lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, lora_ops.build_lora_indices(slots, x.device))
    _, side = _record_streams(monkeypatch, [])
    lora_triton = lora_ops._lora_triton()
    written = []  # weak references to the outputs and workspaces of the side stream's launches
    for name, outputs in (("lora_shrink", (7, 9)), ("lora_expand", (0,))):  # (h, workspace) / (y or delta)
        launch = getattr(lora_triton, name)

        def spy(*args, _launch=launch, _outputs=outputs):  # noqa: ANN002, ANN202
            written.extend(weakref.ref(args[i]) for i in _outputs)
            return _launch(*args)

        monkeypatch.setattr(lora_triton, name, spy)
    indices = lora_ops.build_lora_indices(slots, x.device, lora_ops.LoRAOverlap(side, pair))
    object.__setattr__(indices, "plans", _NoPlanCache())
    pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
    assert len(written) == (3 if pair else 2)
    workspace = written[1]()
    assert workspace is not None and workspace.shape[0] > 1, "a split-K shrink: a workspace of its own"
    del workspace
    gc.collect()
    assert all(ref() is not None for ref in written), "a side-stream buffer was freed before the join"
    got = lora_ops.finish_lora(y.clone(), pending, lora_b, starts, indices)
    assert torch.equal(got, want)


def _graph_indices(batch: int, max_loras: int, pair: bool):  # noqa: ANN202
    """(the int32 buffer, indices over it with a side stream, the same without) of a decode graph of
    ``batch`` rows and ``max_loras`` slots (its fixed tile count: ``max_lora_tiles``)."""
    tiles = lora_ops.max_lora_tiles(batch, max_loras)
    buffer = torch.zeros(lora_ops.index_layout(batch, tiles)[0], dtype=torch.int32, device="cuda")
    overlap = lora_ops.LoRAOverlap(torch.cuda.Stream(), pair)
    overlapped = lora_ops.indices_from_buffer(buffer, batch, tiles, overlap=overlap)
    return buffer, overlapped, lora_ops.indices_from_buffer(buffer, batch, tiles)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pair", [False, True], ids=["shrink", "pair"])
def test_gpu_overlapped_lora_in_a_cuda_graph_is_add_lora(monkeypatch, pair) -> None:
    """Two LoRA layers (qkv, then down), the shrink ("pair": and the expand) on a side stream, eagerly
    and captured in one CUDA graph (the fork and join its edges) replayed for two slot assignments:
    every output the one add_lora gives, bitwise with "shrink", within an ulp of fp16 with "pair" (its
    delta is the MMA from zero, added after; add_lora's expand accumulates onto y: lora_ops' module doc).
    The base output is a copy of a precomputed GEMM, short on purpose: a finish not joined to its side
    stream would read ``h`` or the delta before they were written; the outputs are poisoned before each
    replay."""
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    batch, max_loras = 32, 8
    buffer, overlapped, plain = _graph_indices(batch, max_loras, pair)
    tiles, total = overlapped.tile_offsets.numel(), buffer.numel()
    layers = []
    for k, sizes in ((5120, [5120, 1024, 1024]), (13824, [5120])):
        x, lora_a, lora_b, _, _, starts = make_case(batch, k, sizes, max_loras, 16, torch.float16, seed=k)
        weight = torch.randn(sum(sizes), k, dtype=torch.float16, device="cuda") / k**0.5  # [N, K]
        layers.append((x, lora_a, lora_b, x @ weight.T, starts))  # the base output [T, N]
    outputs = [torch.empty_like(base) for *_, base, _ in layers]

    def step(indices) -> list[torch.Tensor]:  # noqa: ANN001
        got = []
        for (x, lora_a, lora_b, base, starts), out in zip(layers, outputs):
            if indices.overlap is None:
                y = lora_ops.add_lora(base.clone(), x, lora_a, lora_b, starts, indices)
            else:
                pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
                y = lora_ops.finish_lora(base.clone(), pending, lora_b, starts, indices)
            out.copy_(y)
            got.append(out.clone())
        return got

    host = np.zeros(total, dtype=np.int32)
    gen = np.random.default_rng(0)
    assignments = (gen.integers(-1, max_loras, batch), np.arange(batch) % 3 - 1)
    lora_ops.fill_index_buffer(host, assignments[0].astype(np.int32), batch, tiles)
    buffer.copy_(torch.from_numpy(host))
    want = step(plain)
    got = step(overlapped)  # eager, and the warm-up before the capture
    torch.cuda.synchronize()

    def assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
        for a, b in zip(got, want):
            if pair:  # one rounding of fp32(y) + delta against the MMA accumulating onto y
                torch.testing.assert_close(a, b, atol=1e-3, rtol=2e-3, msg=what)  # 1-2 ulps of fp16
            else:
                assert torch.equal(a, b), what

    assert_same(got, want, "eager overlap differs from add_lora")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(overlapped)
    for step_slots in assignments:
        lora_ops.fill_index_buffer(host, step_slots.astype(np.int32), batch, tiles)
        buffer.copy_(torch.from_numpy(host))
        want = step(plain)
        for out in outputs:
            out.fill_(float("nan"))  # a replay that wrote nothing fails
        graph.replay()
        torch.cuda.synchronize()
        assert not overlapped.tile_counters.any()
        assert_same(outputs, want, "the graph's overlapped LoRA differs from add_lora")


# ----------------------------------------------------------------------------------------------
# QSERVE_LORA_FUSED_SILU: a gate_up layer's expand inside the SiLU-and-mul (lora_expand_silu_mul_kernel)
# ----------------------------------------------------------------------------------------------


def _expand_then_silu(y, h, lora_b, indices, starts, block_n):  # noqa: ANN001, ANN202
    """The two launches the fused kernel replaces: the expand into a copy of y, then silu_and_mul."""
    from quant_kernels import elementwise_triton

    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    return elementwise_triton.silu_and_mul(lora_triton.lora_expand(y.clone(), h, lora_b, *tiles, starts, block_n))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "t,inter,num_slots,rank,block_n,pad_tiles",
    [
        (1, 40, 1, 8, 64, 0),  # batch-1 decode: one tile, I under one block
        (13, 72, 3, 16, 64, 3),  # decode rows of three adapters and base rows, a graph's empty tiles
        (37, 150, 4, 16, 128, 0),  # prefill runs longer than a tile, I past a block with a tail
        (20, 96, 2, 24, 256, 0),  # a rank under its power-of-two block
        (5, 1100, 2, 8, 64, 0),  # a base row wider than one row block (1,024 columns)
    ],
)
def test_fused_silu_is_expand_then_silu_and_mul(t, inter, num_slots, rank, block_n, pad_tiles, dtype) -> None:
    """The fused launch gives the two launches' output bit for bit (same dots, the sum rounded to the
    activation dtype between them) and the reference's within the kernels' tolerance; y is left as it
    was; rows of the base model are silu_and_mul of y alone."""
    x, lora_a, lora_b, slots, y, starts = make_case(t, 32, [inter, inter], num_slots, rank, dtype, seed=t + inter)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    if pad_tiles:  # a CUDA graph's fixed tile count: empty tiles (length 0) after the real ones
        pad = torch.zeros(pad_tiles, dtype=torch.int32, device=DEVICE)
        padded = (indices.tile_offsets, indices.tile_lens, indices.tile_slots)
        indices = lora_ops.LoRAIndices(
            indices.token_slots,
            indices.sorted_rows,
            *(torch.cat([tile, pad]) for tile in padded),
            indices.tile_counters,
        )
    h = reference_lora.lora_shrink(x, lora_a, indices.token_slots, torch.zeros(t, 2 * rank, dtype=dtype, device=DEVICE))
    y_before = y.clone()
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=DEVICE)
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    got = lora_triton.lora_expand_silu_and_mul(y, h, lora_b, indices.token_slots, *tiles, out, block_n)
    assert got is out and not torch.isnan(out).any(), "a row or column of the output was not written"
    assert torch.equal(y, y_before), "the fused launch wrote the base output"
    assert torch.equal(got, _expand_then_silu(y, h, lora_b, indices, starts, block_n))
    from quant_kernels import reference_elementwise

    want = reference_elementwise.silu_and_mul(
        reference_lora.lora_expand(y.clone(), h, lora_b, indices.token_slots, starts)
    )
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


def test_fused_silu_writes_a_row_with_a_slot_only_from_its_tile() -> None:
    """Each row is written by one program: with every tile emptied (length 0) the rows with a slot keep
    the output's poison and the base rows get their product; with no tile at all (every row a base row)
    every row gets it. (The interpreter runs the tiles' programs last, so a base-row program that also
    wrote a slot's row would go unseen in the other tests; on a GPU the two would race.)"""
    x, lora_a, lora_b, slots, y, starts = make_case(13, 32, [1100, 1100], 3, 8, torch.float16, seed=11)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    mask = torch.from_numpy(slots >= 0).to(DEVICE)
    assert mask.any() and (~mask).any()
    h = torch.zeros(13, 16, dtype=torch.float16, device=DEVICE)
    empty = torch.zeros_like(indices.tile_lens)
    out = torch.full((13, 1100), float("nan"), dtype=torch.float16, device=DEVICE)
    lora_triton.lora_expand_silu_and_mul(
        y, h, lora_b, indices.token_slots, indices.sorted_rows, indices.tile_offsets, empty, indices.tile_slots, out
    )
    from quant_kernels import elementwise_triton  # the launch the fused one replaces

    assert torch.isnan(out[mask]).all(), "a base-row program wrote a row that has a slot"
    assert torch.equal(out[~mask], elementwise_triton.silu_and_mul(y[~mask]))
    base = lora_ops.build_lora_indices(np.full(13, -1, dtype=np.int32), torch.device(DEVICE))
    out.fill_(float("nan"))
    tiles = (base.sorted_rows, base.tile_offsets, base.tile_lens, base.tile_slots)
    lora_triton.lora_expand_silu_and_mul(y, h, lora_b, base.token_slots, *tiles, out)
    assert torch.equal(out, elementwise_triton.silu_and_mul(y))


def test_fused_silu_refuses_what_is_not_a_gate_up() -> None:
    x, lora_a, lora_b, slots, y, starts = make_case(3, 32, [16, 16], 1, 8, torch.float16, seed=1)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    h = torch.zeros(3, 16, dtype=torch.float16, device=DEVICE)
    out = torch.empty(3, 16, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match=r"h \[T, 2R\]"):
        lora_triton.lora_expand_silu_and_mul(y, h[:, :8], lora_b, indices.token_slots, *tiles, out)
    with pytest.raises(ValueError, match="block_n"):
        lora_triton.lora_expand_silu_and_mul(y, h, lora_b, indices.token_slots, *tiles, out, 32)


@pytest.mark.parametrize("mode", ["in order", "shrink", "pair"])
def test_finish_lora_silu_and_mul_is_silu_of_finish_lora(monkeypatch, mode) -> None:
    """``finish_lora_silu_and_mul`` after ``begin_lora`` is ``silu_and_mul(finish_lora(...))``: the fused
    launch after the join (in order: after the shrink; "pair": the delta added, then the plain product),
    bitwise; off the Triton branch, the reference's expand and product. A layer that is not a gate_up
    (one slice) takes the expand, then the product."""
    _cpu_triton_branch(monkeypatch)
    from quant_kernels import elementwise_ops

    x, lora_a, lora_b, slots, y, starts = make_case(9, 256, [48, 48], 3, 8, torch.float16, seed=7)
    _, side = _record_streams(monkeypatch, [])
    overlap = None if mode == "in order" else lora_ops.LoRAOverlap(side, mode == "pair")
    launched = []
    fused = lora_ops._lora_triton().lora_expand_silu_and_mul
    monkeypatch.setattr(lora_ops._lora_triton(), "lora_expand_silu_and_mul", lambda *a: launched.append(1) or fused(*a))

    def both(indices):  # noqa: ANN001, ANN202
        pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
        unfused = elementwise_ops.silu_and_mul(lora_ops.finish_lora(y.clone(), pending, lora_b, starts, indices))
        pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
        return lora_ops.finish_lora_silu_and_mul(y.clone(), pending, lora_b, starts, indices), unfused

    got, want = both(lora_ops.build_lora_indices(slots, x.device, overlap))
    assert torch.equal(got, want)
    assert launched == ([] if mode == "pair" else [1])
    monkeypatch.setattr(lora_ops.kdevice, "triton_serves", lambda device: False)  # off CUDA: the reference
    got, want = both(lora_ops.build_lora_indices(slots, x.device))
    assert torch.equal(got, want) and len(launched) == (0 if mode == "pair" else 1)
    monkeypatch.setattr(lora_ops.kdevice, "triton_serves", lambda device: True)
    one = [0, 96]  # one slice of 96 columns: not a gate_up
    h = reference_lora.lora_shrink(x, lora_a[:, :8], torch.from_numpy(slots), torch.zeros(9, 8, dtype=torch.float16))
    indices = lora_ops.build_lora_indices(slots, x.device)
    got = lora_ops.expand_silu_and_mul(y.clone(), h, lora_b, one, indices)
    assert torch.equal(got, elementwise_ops.silu_and_mul(lora_ops.lora_expand(y.clone(), h, lora_b, one, indices)))


def test_fused_silu_switch(monkeypatch) -> None:
    monkeypatch.delenv(lora_ops.FUSED_SILU_ENV, raising=False)
    assert lora_ops.fused_silu_enabled() is False  # opt-in until a GPU run passed with it
    monkeypatch.setenv(lora_ops.FUSED_SILU_ENV, "1")
    assert lora_ops.fused_silu_enabled() is True
    monkeypatch.setenv(lora_ops.FUSED_SILU_ENV, "yes")
    with pytest.raises(ValueError, match=lora_ops.FUSED_SILU_ENV):
        lora_ops.fused_silu_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch,max_loras", [(1, 1), (32, 8), (128, 32)])
def test_gpu_fused_silu_in_a_cuda_graph_is_expand_then_silu(monkeypatch, batch, max_loras) -> None:
    """Qwen2.5-14B's gate_up (2 x 13,824, rank 16) in a decode graph's padded indices, the shrink beside
    on a side stream: the fused launch, eager and replayed for two slot assignments (one leaving pad
    rows), gives the expand-then-product output within an ulp of fp16 (the expand may fold y into its
    MMA's accumulator where the fused kernel adds it after), and y unchanged."""
    monkeypatch.setenv(lora_ops.TRITON_ENV, "1")
    buffer, indices, plain = _graph_indices(batch, max_loras, pair=False)
    tiles, total = indices.tile_offsets.numel(), buffer.numel()
    x, lora_a, lora_b, _, y, starts = make_case(batch, 5120, [13824, 13824], max_loras, 16, torch.float16, seed=batch)
    out = torch.empty(batch, 13824, dtype=torch.float16, device="cuda")

    def fused() -> None:
        pending = lora_ops.begin_lora(x, lora_a, lora_b, starts, indices)
        out.copy_(lora_ops.finish_lora_silu_and_mul(y, pending, lora_b, starts, indices))

    from quant_kernels import elementwise_ops

    host = np.zeros(total, dtype=np.int32)
    gen = np.random.default_rng(batch)
    # a mix with base rows; fewer rows than the graph's (pad rows) but at batch 1; every row a base row
    assignments = (
        gen.integers(-1, max_loras, batch),
        gen.integers(0, max_loras, max(1, batch - 5)),
        np.full(batch, -1),
    )
    lora_ops.fill_index_buffer(host, assignments[0].astype(np.int32), batch, tiles)
    buffer.copy_(torch.from_numpy(host))
    y_before = y.clone()
    fused()  # eager, and the warm-up before the capture
    want = elementwise_ops.silu_and_mul(lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, plain))
    torch.testing.assert_close(out, want, atol=1e-3, rtol=2e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused()
    for step_slots in assignments:
        lora_ops.fill_index_buffer(host, step_slots.astype(np.int32), batch, tiles)
        buffer.copy_(torch.from_numpy(host))
        want = elementwise_ops.silu_and_mul(lora_ops.add_lora(y.clone(), x, lora_a, lora_b, starts, plain))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, atol=1e-3, rtol=2e-3)
    assert torch.equal(y, y_before)


# ----------------------------------------------------------------------------------------------
# bench/lora.py's switches for short device calls: bad values refused before any work, naming them
# ----------------------------------------------------------------------------------------------


def test_bench_cases_are_checked(monkeypatch, capsys) -> None:
    from bench import lora as bench_lora

    assert bench_lora.parse_cases("32x8, 1x1") == [(32, 8), (1, 1)]
    for bad in ("32-8", "32x", "x8", "0x8", "32x8x1", "3.5x2"):
        with pytest.raises(ValueError, match="--cases"):
            bench_lora.parse_cases(bad)
    for argv, named in (
        (["--cases", "32-8"], "--cases '32-8'"),
        (["--tiny", "--cases", "32x8"], "none of this run's decode-graph cases (4x2)"),  # --tiny has only 4x2
    ):
        monkeypatch.setattr("sys.argv", ["lora.py", *argv])
        with pytest.raises(SystemExit) as stop:
            bench_lora.main()
        assert stop.value.code == 2
        assert named in capsys.readouterr().err
