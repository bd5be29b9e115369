"""W4A16 / W8A16 Triton kernels against the reference (``quant_kernels.reference``).

On CPU the kernels run through TRITON_INTERPRET=1 (see conftest.py) on a reduced, small
parametrization; the ``gpu``-marked tests run the full grid at real sizes on CUDA. Every case
draws fresh random inputs, poisons the output buffer with NaN and checks with explicit
per-dtype tolerances against an fp32 oracle.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
import torch

from quant_kernels import reference
from quant_kernels.layout import PackedQuantWeight, pack_codes

triton = pytest.importorskip("triton")

from quant_kernels import ops, w4a16_triton  # noqa: E402
from quant_kernels.repack import TiledQuantWeight, tile_interleave, untile  # noqa: E402
from quant_kernels.w4a16_triton import W4A16Config, prepare, w4a16_gemm  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Relative Frobenius error bound and (atol relative to max|ref|, rtol) per activation dtype.
TOL = {torch.float16: (3e-3, 4e-3, 1e-2), torch.bfloat16: (2e-2, 3e-2, 5e-2)}


def make_weight(
    k: int,
    n: int,
    group_size: int,
    bits: int = 4,
    asym: bool = False,
    act_order: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    device: str = DEVICE,
    gen: torch.Generator | None = None,
) -> PackedQuantWeight:
    g = k if group_size == -1 else group_size
    num_groups = -(-k // g)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)  # [K, N]
    scales = (torch.rand(num_groups, n, generator=gen) * 0.02 + 0.002).to(scale_dtype)  # [G, N]
    zeros = torch.randint(0, 1 << bits, (num_groups, n), generator=gen).to(torch.uint8) if asym else None
    perm = torch.randperm(k, generator=gen) if act_order else None
    return PackedQuantWeight(bits, g, pack_codes(codes, bits), scales, zeros, perm).to(device)


def oracle(x: torch.Tensor, weight: PackedQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x[:, perm] @ W (+ bias)`` (TF32 off)."""
    xf = x.float()
    if weight.perm is not None:
        xf = xf[:, weight.perm]
    out = xf @ reference.dequantize(weight, torch.float32)
    return out if bias is None else out + bias.float()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    rel_bound, atol_rel, rtol = TOL[dtype]
    rel = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert rel < rel_bound, f"relative error {rel:.2e} >= {rel_bound:.0e}"
    torch.testing.assert_close(out.float(), ref, atol=atol_rel * ref.abs().max().item(), rtol=rtol)


def run_case(m, k, n, group_size, bits, asym, act_order, dtype, config=None, bias=True, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = make_weight(k, n, group_size, bits, asym, act_order, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None  # [N]
    ref = oracle(x, weight, b)
    tiled = prepare(weight)
    counters = torch.zeros(w4a16_triton.num_split_counters(n), dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second call checks that split-K counters were left at zero
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # [M, N] poisoned
        w4a16_gemm(x, tiled, b, config=config, counters=counters, out=out)
        assert_matches(out, ref, dtype)
    assert int(counters.abs().sum()) == 0, "split-K counters not reset"


# ----------------------------------------------------------------------------------------------
# CPU (interpreter): every kernel mode, small sizes, a covering subset of the feature grid
# ----------------------------------------------------------------------------------------------

FMA = W4A16Config("fused", False, False, 1, 32, 1, 4, 2)
FMA_SPLIT = W4A16Config("fused", False, False, 1, 32, 3, 4, 2)
DOT = W4A16Config("fused", True, False, 16, 32, 1, 4, 2)
DOT_SPLIT = W4A16Config("fused", True, False, 16, 32, 2, 4, 2)
DOT_SWAP = W4A16Config("fused", True, True, 16, 32, 2, 4, 2)
DOT_CAT = W4A16Config("fused", True, True, 16, 32, 2, 4, 2, cat=True)  # falls back to PF dots if G < BLOCK_K
DEQ = W4A16Config(kind="dequant")
CPU_CONFIGS = [FMA, FMA_SPLIT, DOT, DOT_SPLIT, DOT_SWAP, DOT_CAT, DEQ, None]

_MS = [1, 2, 3, 7, 16, 33]
_KN = [(256, 48), (128, 40), (192, 64)]  # N not a multiple of 32 in two of them; K=192: partial tiles
_GROUPS = [32, 64, 128, -1]
_FLAGS = list(itertools.product([False, True], [False, True], [torch.float16, torch.bfloat16], [4, 8]))


def _cpu_cases() -> list:
    """A covering design: each value of each axis appears with each kernel mode."""
    cases = []
    for i in range(24):
        cfg = CPU_CONFIGS[i % len(CPU_CONFIGS)]
        m = _MS[(i * 5) % len(_MS)]
        k, n = _KN[(i * 7) % len(_KN)]
        group_size = _GROUPS[(i // 3) % len(_GROUPS)]
        asym, act, dtype, bits = _FLAGS[(i * 3) % len(_FLAGS)]
        if cfg is not None and cfg.kind == "fused" and not cfg.use_dot:
            m = 1  # the FMA path is the GEMV
        cases.append((m, k, n, group_size, bits, asym, act, dtype, cfg))
    return cases


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs the full grid")
@pytest.mark.parametrize(
    "m,k,n,group_size,bits,asym,act_order,dtype,config",
    _cpu_cases(),
    ids=lambda v: v.short() if isinstance(v, W4A16Config) else None,
)
def test_w4a16_interpreter(m, k, n, group_size, bits, asym, act_order, dtype, config) -> None:
    run_case(m, k, n, group_size, bits, asym, act_order, dtype, config, bias=m % 2 == 1, seed=m * 1000 + n)


def test_select_config_is_valid_for_every_m() -> None:
    """Dispatch is pure arithmetic on M; every bucket yields a config the launcher accepts."""
    for k, n in [(5120, 7168), (13824, 5120), (128, 40)]:
        g = min(128, k)
        qweight = torch.zeros(-(-k // 128) * 16, n, dtype=torch.int32)  # [K_pad/8, N], contents unused
        w = TiledQuantWeight(4, g, k, 16, qweight, torch.ones(-(-k // g), n))
        for m in [1, 2, 3, 4, 5, 8, 16, 17, 33, 64, 65, 130, 256, 257, 512, 1024, 4096, 10000]:
            cfg = w4a16_triton.select_config(w, torch.float16, m)
            assert cfg.kind in ("fused", "dequant")
            if cfg.kind == "fused":
                assert (not cfg.use_dot and m == 1) or cfg.block_m >= 16
                if cfg.split_k > 1:
                    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
                    assert tiles <= w4a16_triton.num_split_counters(n)


@pytest.mark.parametrize("bits,k", [(4, 256), (4, 200), (8, 96)])
def test_tile_interleave_roundtrip(bits, k) -> None:
    """Repacking is lossless, pads K to whole tiles, and puts code j of tile t at rows t*BK + j*ib + r."""
    w = make_weight(k, 40, k, bits, device="cpu")
    tiled = tile_interleave(w, chunk_n=16)
    assert tiled.qweight.shape[0] * (32 // bits) % tiled.block_k == 0
    assert torch.equal(untile(tiled).qweight, w.qweight)
    codes = reference.unpack_codes(w.qweight, bits)
    row = min(k - 1, tiled.block_k + 3 * tiled.interleave + 5)
    t, rem = divmod(row, tiled.block_k)
    j, r = divmod(rem, tiled.interleave)
    word = tiled.qweight[t * tiled.interleave + r]
    assert torch.equal((word >> (bits * j)) & ((1 << bits) - 1), codes[row])


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


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, the full grid
# ----------------------------------------------------------------------------------------------

GPU_MS = [1, 2, 3, 7, 16, 33, 64, 130, 512]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", GPU_MS)
@pytest.mark.parametrize("k,n", [(512, 200), (4096, 1544), (5120, 7168)])
def test_w4a16_gpu_default_dispatch(m, k, n) -> None:
    run_case(m, k, n, 128, 4, False, False, torch.float16, None, bias=True, seed=m + n)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 33, 130, 512])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_w4a16_gpu_features(m, group_size, asym, act_order, dtype, bits) -> None:
    run_case(m, 1536, 1000, group_size, bits, asym, act_order, dtype, None, bias=m % 2 == 1, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 130])
def test_w4a16_gpu_every_candidate(m) -> None:
    """Every config the tuner may pick is correct (asym + act-order + bf16, N not a block multiple)."""
    k, n = 2048, 1000
    gen = torch.Generator().manual_seed(m)
    weight = make_weight(k, n, 128, 4, True, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    ref = oracle(x, weight, None)
    tiled = prepare(weight)
    counters = torch.zeros(w4a16_triton.num_split_counters(n), dtype=torch.int32, device="cuda")
    for cfg in w4a16_triton.candidate_configs(m, k, n, tiled.block_k):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16_gemm(x, tiled, None, cfg, counters, out=out)
        assert_matches(out, ref, torch.bfloat16)
    assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_w4a16_gpu_ops_and_cuda_graph() -> None:
    """ops dispatch on CUDA, 3-D input, and replay under a CUDA graph after warm-up."""
    k, n = 5120, 7168
    weight = make_weight(k, n, 128)
    prepared = ops.prepare_w4a16(weight)
    assert isinstance(prepared, ops.W4A16Prepared)
    for m in (1, 16, 64):
        ops.warmup_w4a16(prepared, torch.float16, [m])
        x = torch.randn(m, k, dtype=torch.float16, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.w4a16_linear(x, prepared)
        for _ in range(3):
            x.copy_(torch.randn(m, k, dtype=torch.float16, device="cuda"))
            graph.replay()
            assert_matches(out, oracle(x, weight, None), torch.float16)
    x3 = torch.randn(2, 3, k, dtype=torch.float16, device="cuda")
    assert ops.w4a16_linear(x3, prepared).shape == (2, 3, n)
