"""The MMA-operand W4A16 / W8A16 kernel (``quant_kernels.w4a16_mma_triton``) against the reference.

On CPU the kernel runs through TRITON_INTERPRET=1 (see conftest.py) on a small covering design;
the ``gpu``-marked tests run real sizes on CUDA. Every case draws fresh random inputs, poisons
the output with NaN and checks against an fp32 oracle with per-dtype tolerances.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from quant_kernels import reference
from quant_kernels.layout import PackedQuantWeight, pack_codes, unpack_codes
from quant_kernels.repack import MmaQuantWeight, mma_kwidth, mma_shuffle, mma_unshuffle

triton = pytest.importorskip("triton")

from quant_kernels import w4a16_mma_triton as mma  # noqa: E402
from quant_kernels.w4a16_mma_triton import MmaConfig, w4a16_gemm  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# Relative Frobenius error bound and (atol relative to max|ref|, rtol) per activation dtype.
TOL = {torch.float16: (3e-3, 4e-3, 1e-2), torch.bfloat16: (2e-2, 3e-2, 5e-2)}


def make_weight(k, n, group_size, bits=4, asym=False, act_order=False, device=DEVICE, gen=None) -> PackedQuantWeight:
    g = k if group_size == -1 else group_size
    num_groups = -(-k // g)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)  # [K, N]
    scales = (torch.rand(num_groups, n, generator=gen) * 0.02 + 0.002).half()  # [G, N]
    zeros = torch.randint(0, 1 << bits, (num_groups, n), generator=gen).to(torch.uint8) if asym else None
    perm = torch.randperm(k, generator=gen) if act_order else None
    return PackedQuantWeight(bits, g, pack_codes(codes, bits), scales, zeros, perm).to(device)


def oracle(x: torch.Tensor, weight: PackedQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``x[:, perm] @ W (+ bias)``."""
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


def run_case(m, k, n, group_size, bits, asym, act_order, dtype, config=None, bias=True, seed=0, kwidth=None) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = make_weight(k, n, group_size, bits, asym, act_order, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None  # [N]
    ref = oracle(x, weight, b)
    shuffled = mma.prepare(weight, kwidth)
    counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device=DEVICE)
    for _ in range(2):  # the second call checks that split-K counters were left at zero
        out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # [M, N] poisoned
        w4a16_gemm(x, shuffled, b, config=config, counters=counters, out=out)
        assert_matches(out, ref, dtype)
    assert int(counters.abs().sum()) == 0, "split-K counters not reset"


# ----------------------------------------------------------------------------------------------
# Layout (CPU, no interpreter needed)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,k,n,kwidth", [(4, 256, 64, 2), (4, 200, 72, 2), (8, 96, 40, 2), (4, 128, 64, 4)])
def test_mma_shuffle_roundtrip(bits, k, n, kwidth) -> None:
    w = make_weight(k, n, -1, bits, asym=True, device="cpu")
    s = mma_shuffle(w, kwidth, chunk_n=64)
    assert s.k_pad % 128 == 0 and s.n_pad % 64 == 0
    back = mma_unshuffle(s)
    assert torch.equal(back.qweight, w.qweight)
    assert torch.equal(back.zeros, w.zeros)


def test_mma_shuffle_puts_a_fragment_where_documented() -> None:
    """Spot-check repack's formula: value (n, k) sits at storage row blk16*4 + ga, column kc*256 +
    gl*128 + t*32 + s*16 + h*8 + rh*4 + e*... (kw = 2: 4 k16 steps x (h, rh, e)), in word-value order."""
    k, n = 128, 64
    w = make_weight(k, n, -1, device="cpu")
    codes = unpack_codes(w.qweight, 4)  # [K, N]
    s = mma_shuffle(w, 2)
    fields = [0, 4, 1, 5, 2, 6, 3, 7]  # value v of a word is this 4-bit field
    for nn, kk in [(0, 0), (9, 3), (17, 70), (63, 127), (42, 88)]:
        blk16, r16 = divmod(nn, 16)
        rh, g = divmod(r16, 8)
        ga, gl = divmod(g, 2)
        kc, r64 = divmod(kk, 64)
        st, r16k = divmod(r64, 16)
        h, r8 = divmod(r16k, 8)
        t, e = divmod(r8, 2)
        col = kc * 256 + gl * 128 + t * 32 + st * 8 + h * 4 + rh * 2 + e
        word = int(s.qweight[blk16 * 4 + ga, col // 8]) & 0xFFFFFFFF
        assert (word >> (4 * fields[col % 8])) & 0xF == int(codes[kk, nn]), (nn, kk)


def test_mma_kwidth_by_generation() -> None:
    assert mma_kwidth((9, 0)) == 2 and mma_kwidth((9, 0), (3, 6)) == 2
    # mma.sync: Triton 3.6 / 3.7 want k-width 4 for a register A operand, 3.8+ k-width 2 (PTX-checked)
    assert mma_kwidth((8, 6), (3, 6)) == 4 and mma_kwidth((8, 9), (3, 7)) == 4
    assert mma_kwidth((8, 6), (3, 8)) == 2 and mma_kwidth((8, 0), (3, 9)) == 2
    with pytest.raises(ValueError, match="sm80"):
        mma_kwidth((7, 5))


# ----------------------------------------------------------------------------------------------
# CPU (interpreter): small sizes, a covering subset of the feature grid
# ----------------------------------------------------------------------------------------------

SMALL = MmaConfig(block_m=16, block_n=64, block_k=128)
SPLIT = MmaConfig(block_m=16, block_n=64, block_k=64, split_k=3)
WIDE_M = MmaConfig(block_m=32, block_n=64, block_k=128, split_k=2)
SCALE_W = MmaConfig(block_m=16, block_n=64, block_k=128, split_k=2, scale_w=True)
DEQ = MmaConfig(kind="dequant")
CPU_CONFIGS = [SMALL, SPLIT, WIDE_M, SCALE_W, DEQ, None]

_MS = [1, 3, 16, 33, 7]
_KN = [(256, 64), (192, 72), (384, 40)]  # N not a multiple of 64; K=192 not a multiple of 128
_GROUPS = [32, 64, 128, -1]
_FLAGS = list(itertools.product([False, True], [False, True], [torch.float16, torch.bfloat16], [4, 8]))


def _cpu_cases() -> list:
    cases = []
    for i in range(18):
        cfg = CPU_CONFIGS[i % len(CPU_CONFIGS)]
        m = _MS[(i * 3) % len(_MS)]
        k, n = _KN[(i * 7) % len(_KN)]
        group_size = _GROUPS[(i // 2) % len(_GROUPS)]
        asym, act, dtype, bits = _FLAGS[(i * 5) % len(_FLAGS)]
        cases.append((m, k, n, group_size, bits, asym, act, dtype, cfg))
    return cases


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize(
    "m,k,n,group_size,bits,asym,act_order,dtype,config",
    _cpu_cases(),
    ids=lambda v: v.short() if isinstance(v, MmaConfig) else None,
)
def test_w4a16_mma_interpreter(m, k, n, group_size, bits, asym, act_order, dtype, config) -> None:
    run_case(m, k, n, group_size, bits, asym, act_order, dtype, config, bias=m % 2 == 1, seed=m * 1000 + n)


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize(
    "m,k,n,group_size,bits,asym,act_order,dtype,config",
    _cpu_cases()[:4],
    ids=lambda v: v.short() if isinstance(v, MmaConfig) else None,
)
def test_w4a16_mma_interpreter_kwidth4(m, k, n, group_size, bits, asym, act_order, dtype, config) -> None:
    """The k-width-4 layout (what sm8x devices get under Triton 3.6 / 3.7) computes the same."""
    run_case(m, k, n, group_size, bits, asym, act_order, dtype, config, seed=m * 1000 + n + 4, kwidth=4)


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize(
    "m,k,n,group_size,asym,act_order,config",
    [
        # group parameters loaded at use or one K-tile ahead; split 4 over 9 K-tiles leaves the last split empty
        (3, 576, 64, 64, True, False, MmaConfig(block_m=16, block_n=64, block_k=64, split_k=4, prefetch=False)),
        (5, 576, 72, 64, True, True, MmaConfig(block_m=16, block_n=64, block_k=64, split_k=4)),
        (17, 384, 64, 32, False, False, MmaConfig(block_m=32, block_n=64, block_k=128, scale_w=True)),
        # dense weight through 64-column slabs; the last slab is partial (N=136)
        (4, 192, 136, 64, True, True, MmaConfig(kind="dequant", chunk_n=64)),
    ],
    ids=lambda v: v.short() if isinstance(v, MmaConfig) else None,
)
def test_w4a16_mma_interpreter_prefetch_and_slabs(m, k, n, group_size, asym, act_order, config) -> None:
    run_case(m, k, n, group_size, 4, asym, act_order, torch.float16, config, bias=True, seed=m * 7 + n)


def _stream_k(per_sm: int, block_m: int = 16, block_k: int = 128) -> MmaConfig:
    return MmaConfig(block_m=block_m, block_n=64, block_k=block_k, stream_k=per_sm)


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize(
    "m,k,n,group_size,bits,asym,act_order,dtype,config",
    [
        # off CUDA the grid is stream_k programs. 9 iterations over 4 programs (2, 2, 2, 3): tiles 0
        # and 1 shared by two programs each, tile 2 whole in the last one (a direct write)
        (1, 384, 192, 128, 4, False, False, torch.float16, _stream_k(4)),
        # more programs than K-tiles per tile: a tile meets three or four programs; several groups per tile
        (3, 384, 200, 64, 4, True, False, torch.float16, _stream_k(9)),
        (5, 384, 136, 32, 4, False, True, torch.bfloat16, _stream_k(7)),
        # two M-tiles (each its own run of tiles), 8-bit weights, 64-deep K-tiles
        (20, 320, 128, 64, 8, False, False, torch.float16, _stream_k(5, block_k=64)),
        # a few programs over one long tile; every tile whole in its own program (direct writes only)
        (2, 640, 64, -1, 4, True, True, torch.float16, _stream_k(3)),
        (7, 256, 128, 128, 4, False, False, torch.float16, _stream_k(2)),
        # a grid of one program falls back to the plain kernel (the stream-K kernel's workspace
        # branch would be compiled against the fp16 output: fp16 atomics do not compile on the GPU)
        (4, 128, 64, 128, 4, False, False, torch.float16, _stream_k(1)),
    ],
    ids=lambda v: v.short() if isinstance(v, MmaConfig) else None,
)
def test_w4a16_mma_interpreter_stream_k(m, k, n, group_size, bits, asym, act_order, dtype, config) -> None:
    """The stream-K grid: tiles written whole, tiles shared by 2-4 programs through the workspace,
    programs spanning several tiles; counters back at zero after each call (``run_case``)."""
    run_case(m, k, n, group_size, bits, asym, act_order, dtype, config, bias=m % 2 == 1, seed=m * 31 + n)


def test_stream_k_configs_are_fixed_like_split_k() -> None:
    """Stream-K needs the split-K counters: wide M (more than 4 M-tiles) or N tiles under 64 rows fall
    back to the plain grid, and a stream-K config never also splits K."""
    cfg = MmaConfig(block_m=16, block_n=64, block_k=128, split_k=4, stream_k=3)
    assert mma._fix(cfg, 16, 1024, 256, 128).stream_k == 3 and mma._fix(cfg, 16, 1024, 256, 128).split_k == 1
    assert mma._fix(cfg, 16 * 5, 1024, 256, 128).stream_k == 0  # 5 M-tiles: more than the counters hold
    narrow = MmaConfig(block_m=16, block_n=32, block_k=128, num_warps=2, stream_k=3)
    assert mma._fix(narrow, 16, 1024, 256, 128).stream_k == 0  # 32-row tiles: the counters are sized for 64
    assert "sk3" in mma._fix(cfg, 1, 1024, 256, 128).short()


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize("m,expected", [(100, "m128 n64 k128 s3 w4 st3"), (200, "m128 n64 k128 s3 w4 st3")])
def test_default_dispatch_k_heavy_m65_to_256(m, expected) -> None:
    """The K-heavy (down-projection) rule for M 65-256: split-K by 3, picked by the built-in table
    (no pinned config), computes what the reference computes."""
    k, n, group_size = 384, 64, 64
    w = mma.prepare(make_weight(k, n, group_size, device="cpu"))
    assert mma.select_config(w, torch.float16, m).short() == expected
    run_case(m, k, n, group_size, 4, True, False, torch.float16, None, seed=m + 11)


def test_dequant_slabs_reject_misaligned_ranges() -> None:
    w = mma.prepare(make_weight(128, 136, 64, device="cpu"))
    with pytest.raises(ValueError, match="64-aligned"):
        mma.dequantize_dense(w, torch.float16, n0=32, n1=96)
    assert mma._fix(MmaConfig(kind="dequant", chunk_n=100), 1, 128, 136, 64).chunk_n == 64
    assert mma._fix(MmaConfig(kind="dequant", chunk_n=200), 1, 128, 136, 64).chunk_n == 0  # >= N: one slab


def test_ampere_table_is_opt_in_and_only_on_sm80_to_89(monkeypatch) -> None:
    """QSERVE_W4A16_AMPERE_TABLE=1 picks the Ampere proxy's table on an sm8x device only."""
    from quant_kernels import device as kdevice

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(kdevice, "capability", lambda device: (8, 6))
    assert not mma._uses_ampere_table(cuda)  # not asked for
    monkeypatch.setenv(mma.AMPERE_TABLE_ENV, "1")
    assert mma._uses_ampere_table(cuda)
    assert not mma._uses_ampere_table(torch.device("cpu"))
    monkeypatch.setattr(kdevice, "capability", lambda device: (9, 0))
    assert not mma._uses_ampere_table(cuda)  # Hopper keeps the H200 rules


@pytest.mark.skipif(CUDA, reason="CPU interpreter subset; the GPU runs real sizes")
@pytest.mark.parametrize(
    "m,expected",
    [(16, None), (40, "m64 n128 k128 sk2 w4 st3"), (100, "m128 n128 k128 sk1 w8 st3"), (200, "dequant+mm")],
)
def test_ampere_table_dispatch(m, expected, monkeypatch) -> None:
    """The table's rules through ``select_config`` (the device check stubbed: CPU weights), and its
    stream-K launches compute what the reference computes (the interpreter's grid: one SM)."""
    k, n, group_size = 384, 128, 64
    w = mma.prepare(make_weight(k, n, group_size, device="cpu"))
    plain = mma.select_config(w, torch.float16, m).short()
    monkeypatch.setattr(mma, "_uses_ampere_table", lambda device: True)
    got = mma.select_config(w, torch.float16, m).short()
    assert got == (plain if expected is None else expected)
    run_case(m, k, n, group_size, 4, True, False, torch.float16, None, seed=m + 5)


def test_select_config_is_valid_for_every_m(monkeypatch) -> None:
    """Dispatch is pure arithmetic on M; every bucket yields a config the launcher accepts (the H200
    rules, then the opt-in Ampere table)."""
    _check_every_m()
    monkeypatch.setattr(mma, "_uses_ampere_table", lambda device: True)
    _check_every_m()


def _check_every_m() -> None:
    for k, n in [(5120, 7168), (13824, 5120), (128, 40), (5120, 1088), (2048, 5184)]:
        for g in (32, 128, k):
            qweight = torch.zeros(-(-n // 64) * 16, -(-k // 128) * 64, dtype=torch.int32)  # contents unused
            w = MmaQuantWeight(4, g, k, n, 2, qweight, torch.ones(-(-k // g), n))
            for m in [1, 2, 3, 8, 16, 17, 33, 64, 65, 130, 256, 257, 512, 1024, 4096, 10000]:
                cfg = mma.select_config(w, torch.float16, m)
                assert cfg.kind in ("mma", "dequant")
                if cfg.kind == "mma":
                    assert cfg.block_m >= 16 and cfg.block_n >= 16 * cfg.num_warps
                    # the weight loads are unmasked: tiles must not run past the 64-row-padded storage
                    assert (-(-n // 64) * 64) % cfg.block_n == 0, (n, m, cfg.short())
                    assert g % cfg.block_k == 0 or g >= k or cfg.block_k % g == 0
                    if cfg.split_k > 1:
                        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
                        assert tiles <= mma.num_split_counters(n)


# ----------------------------------------------------------------------------------------------
# GPU: real sizes
# ----------------------------------------------------------------------------------------------

GPU_MS = [1, 2, 3, 7, 16, 33, 64, 130, 512]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", GPU_MS)
@pytest.mark.parametrize("k,n", [(512, 200), (4096, 1544), (5120, 7168)])
def test_w4a16_mma_gpu_default_dispatch(m, k, n) -> None:
    run_case(m, k, n, 128, 4, False, False, torch.float16, None, bias=True, seed=m + n)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 16, 65, 128, 129, 256])
@pytest.mark.parametrize("k,n", [(5120, 27648), (13824, 5120)])
@pytest.mark.parametrize(
    "group_size,dtype",
    [(128, torch.float16), (64, torch.float16), (32, torch.float16), (128, torch.bfloat16)],
    ids=["g128-fp16", "g64-fp16", "g32-fp16", "g128-bf16"],
)
def test_w4a16_mma_gpu_dispatch_at_model_shapes(m, k, n, group_size, dtype) -> None:
    """The built-in dispatch at Qwen2.5-14B's gate_up / down shapes, three launches each into
    poisoned outputs: configs that race (the second session's scales-on-weights 64-deep K-tiles
    gave wrong or non-finite output from run to run only at these sizes) fail here. Groups 64 and 32
    put several groups in each 128-deep K-tile, which forces scales on the weights: under Triton 3.6
    that path chained its MMAs across iterations and its SASS rewrote in-flight A registers
    (tests/kernels/test_w4a16_sass.py) at M 1-2 too."""
    gen = torch.Generator().manual_seed(m + k + group_size)
    weight = make_weight(k, n, group_size, gen=gen)
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    ref = oracle(x, weight, None)
    shuffled = mma.prepare(weight)
    counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda")
    for _ in range(3):
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        w4a16_gemm(x, shuffled, None, None, counters, out=out)
        assert_matches(out, ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 33, 130])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("asym,act_order", [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_w4a16_mma_gpu_features(m, group_size, asym, act_order, dtype, bits) -> None:
    run_case(m, 1536, 1000, group_size, bits, asym, act_order, dtype, None, bias=m % 2 == 1, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 128])
@pytest.mark.parametrize("k,n", [(5120, 5120), (13824, 5120), (5120, 27648)])
def test_w4a16_mma_gpu_stream_k_at_model_shapes(m, k, n) -> None:
    """The stream-K candidates at Qwen2.5-14B's o / down / gate_up shapes, three launches each into
    poisoned outputs: on the GPU the programs sharing a tile really race for its counter (the
    interpreter runs them one after another)."""
    gen = torch.Generator().manual_seed(m + n)
    weight = make_weight(k, n, 128, gen=gen)
    x = torch.randn(m, k, generator=gen).half().cuda()
    ref = oracle(x, weight, None)
    shuffled = mma.prepare(weight)
    counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda")
    configs = [cfg for cfg in mma.candidate_configs(m, k, n, 128) if cfg.stream_k]
    assert configs
    for cfg in configs:
        for _ in range(3):
            out = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
            w4a16_gemm(x, shuffled, None, cfg, counters, out=out)
            assert_matches(out, ref, torch.float16)
    assert int(counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16, 64, 256])
def test_w4a16_mma_gpu_every_candidate(m) -> None:
    """Every config the sweep may pick is correct (asym + act-order + bf16, N not a block multiple)."""
    k, n = 2048, 1000
    gen = torch.Generator().manual_seed(m)
    weight = make_weight(k, n, 128, 4, True, True, gen=gen)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    ref = oracle(x, weight, None)
    shuffled = mma.prepare(weight)
    counters = torch.zeros(mma.num_split_counters(n), dtype=torch.int32, device="cuda")
    for cfg in mma.candidate_configs(m, k, n, 128):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        w4a16_gemm(x, shuffled, None, cfg, counters, out=out)
        assert_matches(out, ref, torch.bfloat16)
    assert int(counters.abs().sum()) == 0


def test_ops_prepared_weight_used_off_cuda_is_unshuffled() -> None:
    """A CUDA-prepared (shuffled) weight applied to a CPU tensor falls back to the reference exactly."""
    from quant_kernels import ops

    w = make_weight(192, 72, 64, asym=True, act_order=True, device="cpu")
    prepared = ops.W4A16Prepared(weight=mma.prepare(w), counters=torch.zeros(1, dtype=torch.int32))
    x = torch.randn(3, 192)  # [M, K]
    torch.testing.assert_close(ops.w4a16_linear(x, prepared), reference.w4a16_matmul(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_w4a16_mma_gpu_ops_and_cuda_graph() -> None:
    """ops dispatch picks the MMA kernel on CUDA; 3-D input; replay under a CUDA graph after warm-up."""
    from quant_kernels import ops

    k, n = 5120, 7168
    weight = make_weight(k, n, 128)
    prepared = ops.prepare_w4a16(weight)
    assert isinstance(prepared, ops.W4A16Prepared) and isinstance(prepared.weight, MmaQuantWeight)
    for m in (1, 16, 64, 256):
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


@pytest.mark.parametrize("capability,served", [((7, 5), False), ((8, 6), True), ((9, 0), True)])
def test_pre_ampere_cards_take_the_reference_path(monkeypatch, capability, served) -> None:
    """The MMA layout needs sm80+: on a Turing card the weight stays canonical and takes the
    reference path (``quant_kernels.ops``) instead of failing to load (mma_kwidth refuses sm75)."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    weight = SimpleNamespace(qweight=SimpleNamespace(device=torch.device("cuda", 0)), group_size=128, in_features=256)
    assert mma.supports(weight) is served
    if not served:
        from quant_kernels import ops

        assert ops.prepare_w4a16(weight) is weight  # canonical: ops.w4a16_linear's reference path


def test_counters_of_another_dtype_are_refused() -> None:
    """The counters are an int32 argument in every launch: anything else is refused by name (a fp16
    tensor there is what broke main at b0d3937, issue 24)."""
    w = mma.prepare(make_weight(256, 128, 128, device="cpu"), kwidth=2)
    x = torch.randn(1, 256, dtype=torch.float16)  # [M, K]
    with pytest.raises(ValueError, match="counters must be int32"):
        w4a16_gemm(x, w, counters=torch.zeros(8, dtype=torch.float16))


@pytest.mark.parametrize(
    "max_shared,has_zeros,stages_in,expected",
    [
        (None, True, 6, 6),  # off CUDA: no limit
        (232448, True, 3, 3),  # sm90: every config as measured
        (166912, True, 6, 6),  # sm80 (163 KB)
        (101376, False, 3, 3),  # sm86 / sm89, symmetric 128 x 128: 80 KB fits
        (101376, True, 3, 2),  # ... with zero points: 112 KB at 3 stages does not
        (101376, False, 6, 4),  # the 6-stage candidates
    ],
)
def test_fit_shared_takes_stages_only_where_a_block_would_be_refused(
    max_shared, has_zeros, stages_in, expected
) -> None:
    cfg = MmaConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=stages_in)
    assert mma.fit_shared(cfg, max_shared, has_zeros).num_stages == expected
    small = MmaConfig(block_m=16, block_n=64, block_k=128, num_stages=4)  # decode tiles: untouched
    assert mma.fit_shared(small, 101376, has_zeros) == small
    assert mma.fit_shared(mma.DEQUANT, 101376, has_zeros) == mma.DEQUANT
