"""Multi-LoRA kernels (``quant_kernels.lora_triton``) against the reference, and the reference
against plain per-row matrix products.

On CPU the kernels run through TRITON_INTERPRET=1 (conftest.py) at small sizes: rows of several
adapters and of the base model interleaved, prefill-like runs longer than a tile, ranks below the
maximum (zero padding), 1 / 2 / 3 output slices of unequal widths. Every case draws fresh random
inputs; the shrink output is NaN-poisoned (base rows must stay NaN: never written) and the expand
updates a copy of the base output whose base rows must come back bit-identical. The ``gpu`` tests
run Qwen2.5-14B sizes through ``lora_ops.add_lora`` with the Triton opt-in.

Tolerances: kernel and reference both accumulate in fp32 and round at the same points; they differ
by summation order only (plus the interpreter's bf16 truncation), so one or two ulps of the
activation dtype.
"""

from __future__ import annotations

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


def run_case(t, k, sizes, num_slots, rank, dtype, seed, pad_tiles: int = 0) -> None:
    x, lora_a, lora_b, slots, y, starts = make_case(t, k, sizes, num_slots, rank, dtype, seed)
    indices = lora_ops.build_lora_indices(slots, torch.device(DEVICE))
    mask = torch.from_numpy(slots >= 0).to(DEVICE)
    tiles = (indices.sorted_rows, indices.tile_offsets, indices.tile_lens, indices.tile_slots)
    if pad_tiles:  # a CUDA graph's fixed tile count: empty tiles (length 0) after the real ones
        pad = torch.zeros(pad_tiles, dtype=torch.int32, device=DEVICE)
        tiles = (tiles[0], *(torch.cat([tile, pad]) for tile in tiles[1:]))
    h = torch.full((t, lora_a.shape[1]), float("nan"), dtype=dtype, device=DEVICE)
    lora_triton.lora_shrink(x, lora_a, *tiles, len(sizes), h)
    h_ref = reference_lora.lora_shrink(x, lora_a, indices.token_slots, torch.full_like(h, float("nan")))
    assert torch.isnan(h[~mask]).all(), "base rows of the shrink output were written"
    assert not torch.isnan(h[mask]).any(), "rows with an adapter were not written"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(h[mask].float(), h_ref[mask].float(), atol=atol, rtol=rtol)
    out = lora_triton.lora_expand(y.clone(), h_ref, lora_b, *tiles, starts)
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


@pytest.mark.parametrize("dtype", [torch.float16], ids=str)
def test_empty_padding_tiles_do_nothing(dtype) -> None:
    run_case(11, 48, [32, 16], 3, 8, dtype, seed=5, pad_tiles=4)


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
    assert ind.sorted_rows.tolist() == [2, 6] + list(range(7, 25)) + [0, 3, 4]
    assert ind.tile_slots.tolist() == [0, 1, 1, 2]
    assert ind.tile_offsets.tolist() == [0, 2, 18, 20] and ind.tile_lens.tolist() == [2, 16, 2, 3]
    empty = lora_ops.build_lora_indices(np.full(4, -1, dtype=np.int32), torch.device("cpu"))
    assert empty.tile_offsets.numel() == 0 and empty.sorted_rows.numel() == 0


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
