"""The W4A16 op's dispatch (``quant_kernels.ops``): which weights the MMA kernel family serves, the
group sizes whose boundaries cut its K-tiles (48, 80: the padded act-order groups of a row-parallel
shard), and the reference path for the rest.

Kernels run through TRITON_INTERPRET=1 at small sizes (conftest.py) and at real sizes on CUDA
(``gpu`` marks); every case checks a NaN-poisoned output against an fp32 oracle.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from quant_kernels import ops, reference

triton = pytest.importorskip("triton")

from quant_kernels import w4a16_mma_triton as mma  # noqa: E402
from quant_kernels.w4a16_mma_triton import MmaConfig  # noqa: E402
from tests.kernels.test_w4a16_mma import (  # noqa: E402
    DEVICE,
    assert_matches,
    make_weight,
    oracle,
    run_case,
)

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize(
    "group_size,served",
    [(16, True), (48, True), (80, True), (96, True), (160, True), (32, True), (128, True), (-1, True)]
    + [(24, False), (40, False), (72, False)],  # boundaries off the 16-row steps: the reference path
)
def test_the_mma_kernel_serves_groups_in_steps_of_16(group_size, served) -> None:
    assert mma.supports(make_weight(960, 16, group_size, device="cpu")) is served


@pytest.mark.parametrize(
    "block_k,group_size,expected",
    [(128, 80, 8), (64, 80, 4), (128, 48, 8), (128, 96, 4), (64, 96, 2), (128, 32, 4), (128, 128, 1), (64, 256, 1)],
)
def test_groups_per_tile(block_k, group_size, expected) -> None:
    """NG: the runs of one group a K-tile holds (the group size's when groups divide the tile)."""
    assert mma.groups_per_tile(block_k, group_size, 4096) == expected


_RUNS = [
    MmaConfig(block_m=16, block_n=64, block_k=64, split_k=3),  # 64-row tiles: NG 4 for 80, 2 for 96
    MmaConfig(block_m=16, block_n=64, block_k=128, split_k=2, prefetch=False),  # NG 8, parameters at use
    MmaConfig(block_m=32, block_n=64, block_k=128, stream_k=3),
    MmaConfig(kind="dequant", chunk_n=64),
    None,  # the built-in dispatch
]


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize(
    "m,k,n,group_size,bits,asym,act_order,dtype,config",
    [
        # K not a multiple of the group: the last group is partial; of the last K-tile's runs some lie past K
        (3, 240, 72, 80, 4, True, True, torch.float16, _RUNS[0]),
        (5, 200, 64, 80, 4, False, False, torch.bfloat16, _RUNS[1]),
        (17, 288, 64, 48, 4, True, False, torch.float16, _RUNS[2]),
        (4, 192, 136, 96, 8, True, True, torch.float16, _RUNS[3]),
        (1, 320, 40, 48, 4, False, True, torch.float16, _RUNS[4]),
        (2, 480, 64, 96, 4, True, False, torch.bfloat16, _RUNS[0]),
    ],
    ids=lambda v: v.short() if isinstance(v, MmaConfig) else None,
)
def test_groups_that_cut_the_k_tiles_in_the_interpreter(m, k, n, group_size, bits, asym, act_order, dtype, config):
    run_case(m, k, n, group_size, bits, asym, act_order, dtype, config, bias=m % 2 == 1, seed=m * 31 + k)


def test_ops_cpu_path_uses_reference() -> None:
    w = make_weight(64, 24, 32, asym=True, act_order=True, device="cpu")
    prepared = ops.prepare_w4a16(w)
    x = torch.randn(2, 3, 64)  # [..., K]
    out = ops.w4a16_linear(x, prepared)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, reference.w4a16_matmul(x, w))


def test_ops_imports_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from quant_kernels import ops\n"
        "from quant_kernels.layout import PackedQuantWeight\n"
        "w = PackedQuantWeight(4, 32, torch.zeros(8, 16, dtype=torch.int32), torch.ones(2, 16))\n"
        "p = ops.prepare_w4a16(w)\n"
        "assert ops.w4a16_linear(torch.randn(3, 64), p).shape == (3, 16)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 33, 130, 512])
@pytest.mark.parametrize("group_size", [16, 48, 80, 96])
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_groups_in_steps_of_16_take_the_mma_kernel(m, group_size, asym, act_order, dtype, bits) -> None:
    """Groups in 16-row steps (what a row-parallel act-order shard pads to) go through the MMA kernel
    family through ``ops``, the weight's groups as they are, and give the weight's product."""
    gen = torch.Generator().manual_seed(m * 100 + group_size)
    k, n = 1920, 1000
    weight = make_weight(k, n, group_size, bits, asym, act_order, gen=gen)
    prepared = ops.prepare_w4a16(weight)
    assert isinstance(prepared, ops.W4A16Prepared) and prepared.weight.group_size == group_size
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)  # [N]
    for _ in range(2):  # the second call: the split-K counters were left at zero
        assert_matches(ops.w4a16_linear(x, prepared, b), oracle(x, weight, b), dtype)
    assert int(prepared.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 130])
@pytest.mark.parametrize("group_size", [48, 80])
def test_gpu_every_candidate_on_groups_that_cut_the_k_tiles(m, group_size) -> None:
    """Every config the tuner may pick (64- and 128-row K-tiles, split-K, stream-K, the dense slabs)
    on groups of 48 and 80 rows, asymmetric with act-order, bf16, N not a block multiple."""
    k, n = 2400, 1000
    gen = torch.Generator().manual_seed(m + group_size)
    weight = make_weight(k, n, group_size, 4, True, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()  # [M, K]
    ref = oracle(x, weight, None)
    shuffled = mma.prepare(weight)
    counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda")
    for cfg in mma.candidate_configs(m, k, n, group_size):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")  # [M, N] poisoned
        mma.w4a16_gemm(x, shuffled, None, cfg, counters, out=out)
        assert_matches(out, ref, torch.bfloat16)
    assert int(counters.abs().sum()) == 0
