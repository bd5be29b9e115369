"""Triton paged-attention kernels (``quant_kernels.attention_triton``) against the references.

On CPU the kernels run through TRITON_INTERPRET=1 (see conftest.py) on tiny, hand-picked cases
with small tiles (so loops, splits and page boundaries are crossed at tiny sizes); the
``gpu``-marked tests run a full grid (decode / prefill / mixed x block size 16, 32 x GQA 1, 4 x
head dim 64, 128 x fp16, bf16 x model-dtype, fp8, int8 cache) at real sizes on CUDA. Every case
draws fresh random inputs, poisons the output with NaN, and checks against the fp32 reference
(``reference`` for model-dtype caches, ``reference_kv_quant`` for quantized ones) with explicit
per-dtype tolerances; quantized caches are also bounded against the unquantized result. A split
decode launches ``paged_attention_reduce_kernel`` once; one split never does.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass, replace

import pytest
import torch

from quant_kernels import attention_ops, reference, reference_kv_quant

triton = pytest.importorskip("triton")

from quant_kernels import attention_triton  # noqa: E402
from quant_kernels.attention_triton import AttentionConfig  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
# Relative Frobenius bound, atol relative to max|ref|, rtol; per activation dtype.
TOL = {torch.float16: (4e-3, 4e-3, 1e-2), torch.bfloat16: (2e-2, 3e-2, 5e-2)}
# Relative Frobenius error of a quantized cache against the unquantized one (random normal K/V).
QUANT_ERR = {"fp8": 6e-2, "int8": 3e-2}
# Small tiles for the interpreter: several tiles, pages and splits at tiny sizes.
SMALL = AttentionConfig(decode_block_n=16, prefill_block_m=16, prefill_block_n=16, min_split_tokens=16)
SMALL_BYTES = replace(SMALL, decode_packed=False)  # fp8 / int8 decode read byte-wise, not 4 codes a word


@dataclass(frozen=True)
class Case:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    cache: str = "auto"
    window: int | None = None
    strided: bool = False  # q/k/v sliced from one qkv tensor; K/V caches are views of one page buffer
    per_head_scale: bool = False
    num_splits: int | None = None
    config: AttentionConfig | None = None


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]
    value: torch.Tensor  # [T, Hkv, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    seq_lens: torch.Tensor  # int64 [S]
    query_start_loc: torch.Tensor  # int64 [S + 1]
    slot_mapping: torch.Tensor  # int64 [T]
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    raw_key_cache: torch.Tensor  # unquantized cache contents (model dtype)
    raw_value_cache: torch.Tensor


def make_batch(case: Case, gen: torch.Generator, device: str = DEVICE) -> Batch:
    """Random context already in the cache; this step's new K/V not yet stored."""
    h, hkv, d, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
    qlens, slens = torch.tensor(case.query_lens), torch.tensor(case.seq_lens)
    assert (qlens >= 1).all() and (qlens <= slens).all()
    num_seqs, num_tokens = len(qlens), int(qlens.sum())
    blocks_per_seq = [-(-s // bs) for s in case.seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, max(blocks_per_seq) + 1, dtype=torch.int32)  # padded with block 0
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = ids[used : used + n]
        used += n

    qkv = torch.randn(num_tokens, (h + 2 * hkv) * d, generator=gen).to(case.dtype)  # [T, (H + 2 Hkv) D]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.view(num_tokens, h, d), k.view(num_tokens, hkv, d), v.view(num_tokens, hkv, d)
    if not case.strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

    raw = torch.randn(num_blocks, 2, bs, hkv, d, generator=gen).to(case.dtype)  # [blocks, K|V, bs, Hkv, D]
    cache_dtype = CACHE_DTYPES[case.cache]
    k_scale = v_scale = None
    if cache_dtype is None:
        pages = raw.clone()
    else:
        k_scale = reference_kv_quant.compute_kv_scale(raw[:, 0], cache_dtype, per_head=case.per_head_scale)
        v_scale = reference_kv_quant.compute_kv_scale(raw[:, 1], cache_dtype, per_head=case.per_head_scale)
        pages = torch.stack(
            [
                reference_kv_quant.quantize_kv(raw[:, 0], k_scale, cache_dtype),
                reference_kv_quant.quantize_kv(raw[:, 1], v_scale, cache_dtype),
            ],
            dim=1,
        )  # [blocks, 2, bs, Hkv, D]
    if case.strided:
        key_cache, value_cache = pages[:, 0], pages[:, 1]  # views with a page stride of 2 * bs * Hkv * D
    else:
        key_cache, value_cache = pages[:, 0].contiguous(), pages[:, 1].contiguous()

    qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
    qsl[1:] = qlens.cumsum(0)
    pos = torch.cat([torch.arange(s - n, s) for n, s in zip(case.query_lens, case.seq_lens)])  # [T]
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlens)
    slots = tables[seq_of_token, pos // bs].long() * bs + pos % bs  # [T]

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return Batch(
        query=dev(q),
        key=dev(k),
        value=dev(v),
        key_cache=dev(key_cache),
        value_cache=dev(value_cache),
        block_tables=dev(tables),
        seq_lens=dev(slens.long()),
        query_start_loc=dev(qsl),
        slot_mapping=dev(slots),
        k_scale=dev(k_scale),
        v_scale=dev(v_scale),
        raw_key_cache=dev(raw[:, 0].contiguous()),
        raw_value_cache=dev(raw[:, 1].contiguous()),
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def assert_matches(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    rel_bound, atol_rel, rtol = TOL[dtype]
    rel = rel_err(out, ref)
    assert rel < rel_bound, f"relative error {rel:.2e} >= {rel_bound:.0e}"
    torch.testing.assert_close(out.float(), ref.float(), atol=atol_rel * ref.abs().max().item(), rtol=rtol)


def assert_cache_matches(kernel_cache: torch.Tensor, ref_cache: torch.Tensor, scale: torch.Tensor | None) -> None:
    """Model dtype: bit-equal. fp8 / int8: codes equal up to the rounding of the fp32 division
    (at most one code step apart, and almost all equal)."""
    if not reference_kv_quant.is_quantized(ref_cache.dtype):
        assert torch.equal(kernel_cache, ref_cache)
        return
    equal = (kernel_cache.view(torch.uint8) == ref_cache.view(torch.uint8)).float().mean().item()
    assert equal > 0.999, f"only {equal:.4%} of the codes match"
    a = reference_kv_quant.dequantize_kv(kernel_cache, scale)
    b = reference_kv_quant.dequantize_kv(ref_cache, scale)
    if ref_cache.dtype == torch.int8:
        assert (kernel_cache.int() - ref_cache.int()).abs().max().item() <= 1
    else:  # one e4m3 step: 2**-3 relative for normals, 2**-9 * scale for subnormals
        step = scale.reshape(-1, 1) if scale.numel() > 1 else scale
        torch.testing.assert_close(a, b, atol=(step * 2.0**-9).max().item(), rtol=2.0**-3)


def run_case(case: Case, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = make_batch(case, gen)
    scale = case.head_dim**-0.5

    # store_kv: kernel into one copy of the cache, reference into another.
    kc_ref, vc_ref = b.key_cache.clone(), b.value_cache.clone()
    reference_kv_quant.store_kv(b.key, b.value, kc_ref, vc_ref, b.slot_mapping, b.k_scale, b.v_scale)
    kc, vc = b.key_cache, b.value_cache
    attention_triton.store_kv(b.key, b.value, kc, vc, b.slot_mapping, b.k_scale, b.v_scale)
    assert_cache_matches(kc, kc_ref, b.k_scale)
    assert_cache_matches(vc, vc_ref, b.v_scale)

    # attention over the same (reference-stored) cache.
    args = (
        b.query,
        kc_ref,
        vc_ref,
        b.block_tables,
        b.seq_lens,
        b.query_start_loc,
        max(case.query_lens),
        max(case.seq_lens),
        scale,
        case.window,
        b.k_scale,
        b.v_scale,
    )
    ref = reference_kv_quant.paged_attention(*args).float()
    for _ in range(2):  # the second call reuses compiled kernels and a fresh poisoned buffer
        out = torch.full_like(b.query, float("nan"))  # [T, H, D] poisoned
        result = attention_triton.paged_attention(*args, out=out, num_splits=case.num_splits, config=case.config)
        assert result is out
        assert_matches(out, ref, case.dtype)


# ----------------------------------------------------------------------------------------------
# CPU (interpreter) cases: tiny, each one aimed at a feature
# ----------------------------------------------------------------------------------------------

CPU_CASES = {
    # decode, GQA 4, lengths 1 / off-block / several tiles; auto splits with small tiles
    "decode-gqa4-autosplit": Case((1, 1, 1, 1), (1, 17, 45, 100), config=SMALL),
    # decode, MHA, head_dim 128, block 32, a non-power-of-two split count, strided views
    "decode-mha-d128-bf16-split3": Case(
        (1, 1), (33, 64), 2, 2, 128, 32, torch.bfloat16, num_splits=3, strided=True, config=SMALL
    ),
    "decode-fp8-window-split2": Case((1, 1, 1), (5, 50, 77), cache="fp8", window=20, num_splits=2, config=SMALL),
    "decode-fp8-bytes-d128-bf16": Case(
        (1, 1), (5, 50), 4, 2, 128, dtype=torch.bfloat16, cache="fp8", num_splits=2, strided=True, config=SMALL_BYTES
    ),
    "decode-int8-bytes": Case((1, 1), (33, 50), cache="int8", config=SMALL_BYTES),
    "decode-int8-perhead-bf16": Case(
        (1, 1),
        (40, 90),
        block_size=32,
        dtype=torch.bfloat16,
        cache="int8",
        per_head_scale=True,
        num_splits=4,
        config=SMALL,
    ),
    # prefill only: one sequence (no decode launch), then an extend over a cached prefix
    "prefill-single": Case((40,), (40,), strided=True, config=SMALL),
    "extend-mha-window-bf16": Case((7, 20), (30, 20), 2, 2, 64, 32, torch.bfloat16, window=8, config=SMALL),
    # mixed batches: decode rows take the split-KV kernel, the rest the prefill kernel
    "mixed-fp8": Case((1, 9, 1, 3), (50, 9, 18, 40), cache="fp8", num_splits=2, strided=True, config=SMALL),
    "mixed-int8-perhead-d128-window": Case(
        (5, 1), (70, 33), 8, 2, 128, 16, torch.bfloat16, "int8", window=16, per_head_scale=True, config=SMALL
    ),
    # the default launch configuration (64-wide tiles)
    "mixed-default-config-mha": Case((3, 1), (20, 90), 4, 1, 128),
    # the flat prefill grid: GQA 3 (5 tokens a block of 16 rows), first tokens at every alignment,
    # sequences shorter than a block, decodes in between, and long cached prefixes whose whole key
    # tiles take the unmasked path
    "flat-grid-gqa3-extends": Case((5, 40, 1, 19, 2, 1, 11), (70, 40, 33, 100, 2, 9, 60), 6, 2, config=SMALL),
    "flat-grid-fp8-prefix": Case((3, 1, 17), (90, 50, 81), 6, 2, cache="fp8", config=SMALL),
}


@pytest.mark.parametrize("name", list(CPU_CASES))
def test_paged_attention_cpu_cases(name: str) -> None:
    run_case(CPU_CASES[name], seed=zlib.crc32(name.encode()))


@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_quantized_cache_error_bounded(cache: str) -> None:
    """fp8 / int8 caches against the unquantized cache holding the same values."""
    case = Case((1, 1, 4), (60, 90, 30), cache=cache, per_head_scale=cache == "int8", config=None if CUDA else SMALL)
    b = make_batch(case, torch.Generator().manual_seed(7))
    common = (b.block_tables, b.seq_lens, b.query_start_loc, 4, 90, case.head_dim**-0.5)
    exact = reference.paged_attention(b.query, b.raw_key_cache, b.raw_value_cache, *common).float()
    out = attention_triton.paged_attention(
        b.query, b.key_cache, b.value_cache, *common, None, b.k_scale, b.v_scale, config=case.config
    )
    assert torch.isfinite(out).all()
    err = rel_err(out, exact)
    assert err < QUANT_ERR[cache], f"{cache} cache error {err:.3e} vs the unquantized cache"


def test_fp8_encoding_matches_torch() -> None:
    """The store kernel's bit-wise e4m3 encoder against torch's cast: every code, every midpoint
    (ties to even), out-of-range values (clamped) and random values; scale 1 so the division is exact."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # drop the NaN codes
    values = finite.view(torch.float8_e4m3fn).float().unique()  # sorted, one zero
    mids = (values[1:] + values[:-1]) / 2
    gen = torch.Generator().manual_seed(3)
    extra = torch.tensor([448.0, -448.0, 449.0, 460.0, -1e4, 1e-12, -1e-12, 0.0, -0.0, 2.0**-10, 2.0**-9 * 1.5])
    x = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), extra, torch.randn(2000, generator=gen) * 30])
    pad = (-x.numel()) % 16
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 1, 16)  # [T, Hkv=1, D=16] float32
    num_tokens = x.shape[0]
    cache = torch.zeros(num_tokens, 1, 1, 16, dtype=torch.float8_e4m3fn)  # block_size 1
    vcache = torch.zeros_like(cache)
    slots = torch.arange(num_tokens)
    one = torch.ones(1)
    kc = cache.to(DEVICE)
    attention_triton.store_kv(x.to(DEVICE), x.to(DEVICE), kc, vcache.to(DEVICE), slots.to(DEVICE), one, one)
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).view(-1)
    got = kc.cpu().view(torch.uint8).view(-1)
    bad = (got != expected).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} codes differ, e.g. x={x.view(-1)[bad[:5]].tolist()}"


def test_store_kv_skips_negative_slots_and_handles_per_head_scale() -> None:
    case = Case((3,), (3,), cache="int8", per_head_scale=True)
    b = make_batch(case, torch.Generator().manual_seed(11))
    slots = b.slot_mapping.clone()
    slots[1] = -1  # a padding token
    kc, vc = b.key_cache.clone(), b.value_cache.clone()
    attention_triton.store_kv(b.key, b.value, kc, vc, slots, b.k_scale, b.v_scale)
    kc_ref, vc_ref = b.key_cache.clone(), b.value_cache.clone()
    keep = slots >= 0
    reference_kv_quant.store_kv(b.key[keep], b.value[keep], kc_ref, vc_ref, slots[keep], b.k_scale, b.v_scale)
    assert_cache_matches(kc, kc_ref, b.k_scale)
    assert_cache_matches(vc, vc_ref, b.v_scale)


def test_int8_cache_needs_scales() -> None:
    b = make_batch(Case((1,), (5,), cache="int8"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="int8"):
        attention_triton.store_kv(b.key, b.value, b.key_cache, b.value_cache, b.slot_mapping)
    with pytest.raises(ValueError, match="int8"):
        reference_kv_quant.quantize_kv(b.key, None, torch.int8)


def test_reference_kv_quant_round_trip() -> None:
    x = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(5))  # [T, Hkv, D]
    for dtype in (torch.float8_e4m3fn, torch.int8):
        s = reference_kv_quant.compute_kv_scale(x, dtype, per_head=True)  # [Hkv]
        assert s.shape == (4,)
        codes = reference_kv_quant.quantize_kv(x, s, dtype)
        assert codes.dtype == dtype
        err = (reference_kv_quant.dequantize_kv(codes, s) - x).abs()
        step = s.view(-1, 1)
        if dtype == torch.int8:  # half a code
            bound = 0.5 * step + 1e-6
        else:  # half an e4m3 step: 2**-4 relative for normals, 2**-10 * scale among subnormals
            bound = 2.0**-4 * x.abs() + 2.0**-10 * step + 1e-6
        assert (err <= bound).all()


def test_dispatcher_uses_reference_off_cuda() -> None:
    """attention_ops on CPU tensors: the references, same signature plus scales."""
    case = Case((1, 4), (20, 9), cache="fp8")
    b = make_batch(case, torch.Generator().manual_seed(2), device="cpu")
    kc, vc = b.key_cache.clone(), b.value_cache.clone()
    attention_ops.store_kv(b.key, b.value, kc, vc, b.slot_mapping, b.k_scale, b.v_scale)
    kc_ref, vc_ref = b.key_cache.clone(), b.value_cache.clone()
    reference_kv_quant.store_kv(b.key, b.value, kc_ref, vc_ref, b.slot_mapping, b.k_scale, b.v_scale)
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    args = (b.query, kc, vc, b.block_tables, b.seq_lens, b.query_start_loc, 4, 20, 0.125)
    out = attention_ops.paged_attention(*args, None, b.k_scale, b.v_scale)
    torch.testing.assert_close(out, reference_kv_quant.paged_attention(*args, None, b.k_scale, b.v_scale))


def _prefill_owner(query_start_loc: list[int], pid: int, block_q: int) -> tuple[int, int]:
    """Host mirror of ``_prefill_work_item``'s search: the last sequence whose first program <= pid."""
    firsts = [start // block_q + s for s, start in enumerate(query_start_loc[:-1])]
    seq = max(s for s, first in enumerate(firsts) if first <= pid)
    return seq, pid - firsts[seq]


@pytest.mark.parametrize("block_q", [1, 3, 5, 12, 64])
def test_flat_prefill_grid_covers_every_query_block(block_q: int) -> None:
    """Every query block of every sequence gets exactly one program of the flat grid, for any mix of
    lengths (a grid built from host integers only: the token and sequence counts)."""
    gen = torch.Generator().manual_seed(block_q)
    for _ in range(50):
        lens = torch.randint(1, 3 * block_q + 2, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        qsl = [0, *torch.cumsum(lens, 0).tolist()]
        grid = attention_triton.prefill_grid_blocks(qsl[-1], len(lens), block_q)
        owners = [_prefill_owner(qsl, pid, block_q) for pid in range(grid)]
        for seq, q_len in enumerate(lens.tolist()):
            blocks = sorted(b for s, b in owners if s == seq)
            assert blocks[: -(-q_len // block_q)] == list(range(-(-q_len // block_q))), (qsl, seq)
            assert len(blocks) == len(set(blocks))


# ----------------------------------------------------------------------------------------------
# The split reduce launch
# ----------------------------------------------------------------------------------------------


def _stored_args(case: Case, b: Batch) -> tuple:
    """``paged_attention``'s positional arguments over the cache after this step's K/V are stored."""
    reference_kv_quant.store_kv(b.key, b.value, b.key_cache, b.value_cache, b.slot_mapping, b.k_scale, b.v_scale)
    return (
        b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, max(case.query_lens),
        max(case.seq_lens), case.head_dim**-0.5, case.window, b.k_scale, b.v_scale,
    )  # fmt: skip


def _attend(case: Case, args: tuple) -> torch.Tensor:
    out = torch.full_like(args[0], float("nan"))  # [T, H, D] poisoned: every row must be written
    return attention_triton.paged_attention(*args, out=out, num_splits=case.num_splits, config=case.config)


class _CountingKernel:
    """A Triton kernel's stand-in that counts its launches (``kernel[grid](...)``) and makes them."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self.grids.append(grid)
        return self.kernel[grid]


def test_split_decode_launches_the_reduce_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split decode launches ``paged_attention_reduce_kernel`` once, after the decode launch; one split
    never launches it (the decode kernel writes the output)."""
    counting = _CountingKernel(attention_triton.paged_attention_reduce_kernel)
    monkeypatch.setattr(attention_triton, "paged_attention_reduce_kernel", counting)
    case = Case((1, 1), (20, 37), 8, 2, num_splits=2, config=SMALL)
    b = make_batch(case, torch.Generator().manual_seed(13))
    args = _stored_args(case, b)
    assert_matches(_attend(case, args), reference_kv_quant.paged_attention(*args).float(), case.dtype)
    assert len(counting.grids) == 1
    _attend(replace(case, num_splits=1), args)
    assert len(counting.grids) == 1


def test_arrival_counters_per_owner_grow_and_keep_old_buffers() -> None:
    """``quant_kernels.device.arrival_counters`` (MoE split-K's and the router's): one
    zeroed buffer per (owner, device), returned as is while large enough, at least doubled past it,
    the replaced one kept alive (a CUDA graph captured with it keeps a valid address)."""
    from quant_kernels import device as kdevice

    cpu = torch.device("cpu")
    first = kdevice.arrival_counters(cpu, 3, "test-owner-a", minimum=4)
    assert first.dtype == torch.int32 and first.numel() == 4 and not first.any()
    assert kdevice.arrival_counters(cpu, 4, "test-owner-a") is first
    assert kdevice.arrival_counters(cpu, 1, "test-owner-b") is not first  # owners never share counters
    grown = kdevice.arrival_counters(cpu, 5, "test-owner-a")
    assert grown.numel() == 8 and not grown.any()
    assert any(old is first for old in kdevice._RETIRED_COUNTERS)


def test_choose_num_splits() -> None:
    assert attention_triton.choose_num_splits(1, 8, 4096, 132, 256) == 16
    assert attention_triton.choose_num_splits(128, 8, 4096, 132, 256) == 1
    assert attention_triton.choose_num_splits(1, 8, 100, 132, 256) == 1
    s = attention_triton.choose_num_splits(3, 2, 1000, 132, 256)
    assert s & (s - 1) == 0 and 1 <= s <= 64


# ----------------------------------------------------------------------------------------------
# GPU: the full grid at real sizes
# ----------------------------------------------------------------------------------------------

GPU_LENS = {  # mode: (query_lens, seq_lens); decode lengths trigger split-KV, none a block multiple
    "decode": ((1,) * 8, (1, 15, 129, 700, 1500, 2049, 2500, 3001)),
    "prefill": ((300, 77, 513), (300, 900, 1037)),
    "mixed": ((1, 300, 1, 77, 1, 2), (2047, 300, 45, 900, 3001, 1000)),
}
_GRID = list(
    itertools.product(
        ["decode", "prefill", "mixed"],
        [16, 32],
        [1, 4],
        [64, 128],
        [torch.float16, torch.bfloat16],
        ["auto", "fp8", "int8"],
    )
)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode,block_size,gqa,head_dim,dtype,cache", _GRID)
def test_paged_attention_gpu(
    mode: str, block_size: int, gqa: int, head_dim: int, dtype: torch.dtype, cache: str
) -> None:
    qlens, slens = GPU_LENS[mode]
    num_kv_heads = 4
    case = Case(
        qlens,
        slens,
        num_kv_heads * gqa,
        num_kv_heads,
        head_dim,
        block_size,
        dtype,
        cache,
        window=700 if block_size == 32 else None,  # sliding window on half the grid
        strided=gqa == 4,
        per_head_scale=cache == "int8",
    )
    run_case(case, seed=zlib.crc32(f"{mode}{block_size}{gqa}{head_dim}{dtype}{cache}".encode()))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "cache,packed", [("auto", True), ("fp8", True), ("fp8", False), ("int8", True), ("int8", False)]
)
def test_decode_qwen14b_shape_gpu(dtype: torch.dtype, cache: str, packed: bool) -> None:
    """Qwen2.5-14B heads (40 q / 8 kv, head_dim 128), long contexts, automatic and forced splits,
    quantized caches read 4 codes a word (default) and byte-wise.
    (bench/attention.py checks the other tile widths, BLOCK_N 32 / 64 / 128, at real sizes.)"""
    cfg = AttentionConfig(decode_packed=packed)
    base = Case((1,) * 4, (1024, 4096, 4097, 333), 40, 8, 128, 16, dtype, cache, config=cfg)
    for splits in (None, 1, 5):
        run_case(replace(base, num_splits=splits), seed=splits or 0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_decode_cuda_graph_replay_gpu() -> None:
    """Fixed num_splits: capture once, change lengths and tables in place, replay."""
    case = Case((1,) * 4, (4096, 4096, 4096, 4096), 40, 8, 128, 16)
    gen = torch.Generator().manual_seed(9)
    b = make_batch(case, gen)
    args = lambda: (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 1, 4096, 0.088)  # noqa: E731
    out = torch.full_like(b.query, float("nan"))
    attention_triton.paged_attention(*args(), out=out, num_splits=8)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention_triton.paged_attention(*args(), out=out, num_splits=8)
    for lens in ((4096, 17, 1000, 2222), (1, 4095, 300, 64)):
        b.seq_lens.copy_(torch.tensor(lens, device=DEVICE))
        b.query.copy_(torch.randn(b.query.shape, generator=gen).to(b.query.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, reference.paged_attention(*args()).float(), case.dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_dispatcher_uses_triton_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = attention_triton.paged_attention
    monkeypatch.setattr(attention_triton, "paged_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = Case((1, 3), (100, 50), cache="fp8")
    b = make_batch(case, torch.Generator().manual_seed(4))
    args = (b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc, 3, 100, 0.125)
    out = attention_ops.paged_attention(*args, None, b.k_scale, b.v_scale)
    assert calls == [1]
    assert_matches(out, reference_kv_quant.paged_attention(*args, None, b.k_scale, b.v_scale).float(), case.dtype)


def test_reference_store_kv_refuses_quantized_caches_and_skips_pad_rows():
    from quant_kernels import reference

    cache = torch.zeros(2, 4, 1, 8)
    key = torch.ones(3, 1, 8)
    reference.store_kv(key, key * 2, cache, cache.clone(), torch.tensor([1, -1, 6]))
    assert cache.view(8, 8)[[1, 6]].eq(1).all() and cache.view(8, 8)[[0, 2, 3, 4, 5, 7]].eq(0).all()
    with pytest.raises(ValueError, match="needs scales"):
        reference.store_kv(key, key, cache.to(torch.int8), cache.to(torch.int8), torch.tensor([0, 1, 2]))


def test_prefill_tiles_follow_the_device_and_the_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hopper-sized shared memory takes the tiles measured on the H200 (long chunks: 128 x 128 keys, 8
    warps, 3 stages); smaller cards, head dims past 128 and callers without a chunk length keep the
    earlier tiles, as does ``QSERVE_PREFILL_TILES=earlier``; set fields of the config win."""
    from quant_kernels import device as kdevice

    cfg, cuda = AttentionConfig(), torch.device("cuda", 0)
    monkeypatch.setattr(kdevice, "max_shared", lambda device: 227 * 1024)
    monkeypatch.delenv("QSERVE_PREFILL_TILES", raising=False)
    assert attention_triton._prefill_launch(cfg, 5, 128, 4096, cuda) == (128, 25, 128, 8, 3)
    assert attention_triton._prefill_launch(cfg, 5, 128, 224, cuda) == (128, 25, 32, 4, 2)
    assert attention_triton._prefill_launch(cfg, 5, 256, 4096, cuda) == (64, 12, 32, 8, 2)
    assert attention_triton._prefill_launch(cfg, 5, 128) == (64, 12, 64, 8, 2)  # the int4 kernel's
    assert attention_triton._prefill_launch(AttentionConfig(prefill_block_n=16), 1, 64, 4096, cuda)[2] == 16
    monkeypatch.setattr(kdevice, "max_shared", lambda device: 99 * 1024)  # sm86 / sm89
    assert attention_triton._prefill_launch(cfg, 5, 128, 4096, cuda) == (64, 12, 64, 8, 2)
    monkeypatch.setattr(kdevice, "max_shared", lambda device: 227 * 1024)
    monkeypatch.setenv("QSERVE_PREFILL_TILES", "earlier")  # the opt-out
    assert attention_triton._prefill_launch(cfg, 5, 128, 4096, cuda) == (64, 12, 64, 8, 2)
