"""KVSwapper (swap preemption's copies): blocks go to the host slots they were given and come back
into the device blocks asked for, exactly, for plain and strided (shared-pool) caches."""

from __future__ import annotations

import pytest
import torch

from qserve.runner import kv_swap
from qserve.runner.kv_swap import KVSwapper, kv_block_bytes

NUM_BLOCKS, BLOCK, HEADS, HEAD = 10, 4, 2, 8


def _caches(strided: bool, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    if not strided:
        return [
            (
                torch.randn(NUM_BLOCKS, BLOCK, HEADS, HEAD, generator=gen).to(dtype),
                torch.randn(NUM_BLOCKS, BLOCK, HEADS, HEAD, generator=gen).to(dtype),
            )
            for _ in range(3)
        ]
    # Like qserve.memory.shared_pool: every cache is a strided view into rows of one byte buffer.
    layer_elems = BLOCK * HEADS * HEAD
    buffer = torch.randn(NUM_BLOCKS, 3 * 2 * layer_elems + 16, generator=gen)
    return [
        tuple(
            buffer[:, (2 * layer + kv) * layer_elems : (2 * layer + kv + 1) * layer_elems].view(
                NUM_BLOCKS, BLOCK, HEADS, HEAD
            )
            for kv in range(2)
        )
        for layer in range(3)
    ]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(kv_swap._BITS_DTYPES[tensor.element_size()])


@pytest.mark.parametrize(
    ("strided", "dtype"),
    [(False, torch.float32), (True, torch.float32), (False, torch.float8_e4m3fn), (False, torch.bfloat16)],
    ids=["contiguous", "shared-pool-views", "fp8", "bf16"],
)
@pytest.mark.parametrize("chunk", [256, 2], ids=["one-chunk", "chunks-of-2"])
def test_swap_out_then_in_restores_blocks_elsewhere(strided, dtype, chunk, monkeypatch):
    monkeypatch.setattr(kv_swap, "SWAP_CHUNK_BLOCKS", chunk)
    caches = _caches(strided, dtype)
    before = [(_bits(k).clone(), _bits(v).clone()) for k, v in caches]
    swapper = KVSwapper(caches, num_host_blocks=6, device=torch.device("cpu"))
    assert swapper.block_bytes == kv_block_bytes(caches) == 2 * 3 * BLOCK * HEADS * HEAD * caches[0][0].element_size()
    out_pairs = [(7, 4), (2, 0), (5, 1), (9, 5)]  # two runs of host slots: 0-1 and 4-5
    swapper.swap_out(out_pairs)
    for layer, (k, v) in enumerate(caches):
        for block, slot in out_pairs:
            assert torch.equal(swapper.host[2 * layer, slot], before[layer][0][block])
            assert torch.equal(swapper.host[2 * layer + 1, slot], before[layer][1][block])
        _bits(k).fill_(77)  # poison: everything swapped in must be written
        _bits(v).fill_(77)
    in_pairs = [(4, 0), (0, 3), (1, 8), (5, 6)]  # host slot -> a different device block
    swapper.swap_in(in_pairs)
    moved = {dst: src for (src, slot_out) in out_pairs for (slot_in, dst) in in_pairs if slot_in == slot_out}
    for layer, (k, v) in enumerate(caches):
        for dst, src in moved.items():
            assert torch.equal(_bits(k)[dst], before[layer][0][src])
            assert torch.equal(_bits(v)[dst], before[layer][1][src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in moved]
        assert (_bits(k)[untouched] == 77).all() and (_bits(v)[untouched] == 77).all()


def test_runs_of_consecutive_slots():
    import numpy as np

    assert kv_swap._runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3, 0), (3, 5, 5), (5, 6, 9)]
    assert kv_swap._runs(np.array([3])) == [(0, 1, 3)]


def test_measured_bandwidth_is_positive_and_harmless():
    caches = _caches(False)
    before = [(k.clone(), v.clone()) for k, v in caches]
    swapper = KVSwapper(caches, num_host_blocks=4, device=torch.device("cpu"))
    assert swapper.measure_bandwidth() > 0
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(caches, before))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_cuda_copies_are_stream_ordered_without_host_syncs(dtype):
    """Pinned pool, non_blocking copies: a swap-out must read the blocks before a later kernel
    overwrites them, and a swap-in must land before a later kernel reads them; no sync between."""
    device = torch.device("cuda")
    num_blocks = 64
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [
        tuple(torch.randn(num_blocks, 16, 8, 128, generator=gen, device=device).to(dtype) for _ in range(2))
        for _ in range(4)
    ]
    before = [(_bits(k).clone(), _bits(v).clone()) for k, v in caches]
    swapper = KVSwapper(caches, num_host_blocks=48, device=device)
    assert swapper.pinned and swapper.host.is_pinned()
    out_pairs = [(b, 40 - b) for b in range(1, 40)]  # 39 blocks, one run of slots 1..39
    swapper.swap_out(out_pairs)
    for k, v in caches:  # enqueued right behind the copies: overwrite every block
        _bits(k).fill_(7)
        _bits(v).fill_(7)
    in_pairs = [(slot, (slot * 5) % num_blocks) for slot in range(1, 40)]  # scattered destinations
    swapper.swap_in(in_pairs)
    readback = [(_bits(k) + 0, _bits(v) + 0) for k, v in caches]  # a kernel reading right after
    torch.cuda.synchronize()
    source = {slot: block for block, slot in out_pairs}
    for layer, (k, v) in enumerate(readback):
        for slot, block in in_pairs:
            assert torch.equal(k[block], before[layer][0][source[slot]]), (layer, slot)
            assert torch.equal(v[block], before[layer][1][source[slot]]), (layer, slot)
