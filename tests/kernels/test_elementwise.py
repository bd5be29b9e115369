"""Fused elementwise Triton kernels (``quant_kernels.elementwise_triton``) against the reference.

On CPU the kernels run through TRITON_INTERPRET=1 (see conftest.py) on small shapes (head and
hidden sizes that are not powers of two, T in {0, 1, 3, 17}, q/k views taken out of one fused
qkv tensor, unsorted positions); the ``gpu``-marked tests run Qwen2.5-14B sizes on CUDA, plus
CUDA-graph capture. Every case draws fresh random inputs, poisons the output buffers with NaN
(``out=``) and checks against ``quant_kernels.reference_elementwise`` with explicit per-dtype
tolerances. The reference itself is the CPU path of ``quant_kernels.elementwise_ops``.

The fused q/k norm + rotary (``qk_norm_rotary_embedding``, ``rotary_kernel`` with ``QK_NORM``)
is checked against the reference norms followed by the reference rotary, at Qwen3's GQA shapes
(32 q / 4 kv heads, D = 128 and 64) and a masked half (D = 40), with rows in a second NTK table;
on the GPU also against the three launches it replaces (q_norm, k_norm, rotary) at
Qwen3-30B-A3B's shapes.

Tolerances: the kernels compute in fp32 like the reference and round at the same points, so on
a GPU they agree to about one ulp of the output dtype (FMA contraction, reduction order, and
silu_and_mul rounding once where torch rounds twice). Triton 3.6's interpreter casts fp32 to
bf16 by truncation, not round-to-nearest, so bf16 is allowed two ulps under the interpreter.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from quant_kernels import elementwise_ops, reference_elementwise

triton = pytest.importorskip("triton")

from quant_kernels import elementwise_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
EPS = 1e-6
# (atol, rtol) per output dtype.
TOL = {
    torch.float16: (1e-2, 4e-3),
    torch.bfloat16: (2e-2, 1.6e-2) if CUDA else (4e-2, 3.2e-2),
    torch.float32: (2e-5, 2e-5),
}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOKENS = [0, 1, 3, 17]


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert out.is_contiguous()
    assert not torch.isnan(out).any(), "unwritten (NaN-poisoned) outputs"
    atol, rtol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def nan_like(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


def rope_tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``[max_positions, head_dim / 2]`` cos/sin, as ``qserve.layers.rotary`` builds them."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return freqs.cos().to(DEVICE), freqs.sin().to(DEVICE)


# ----------------------------------------------------------------------------------------------
# Case runners (shared by the interpreter and the GPU tests)
# ----------------------------------------------------------------------------------------------


def run_rms_norm(t: int, h: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(t, h, dtype=dtype, gen=gen, scale=3.0)  # [T, H]
    weight = randn(h, dtype=dtype, gen=gen)  # [H]
    out = elementwise_triton.rms_norm(x, weight, EPS, out=nan_like((t, h), dtype))
    assert_matches(out, reference_elementwise.rms_norm(x, weight, EPS))


def run_fused_add_rms_norm(t: int, h: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = randn(t, h, dtype=dtype, gen=gen)  # [T, H]
    residual = randn(t, h, dtype=dtype, gen=gen, scale=4.0)  # [T, H]
    weight = randn(h, dtype=dtype, gen=gen)  # [H]
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = elementwise_triton.fused_add_rms_norm(
        x, residual, weight, EPS, out=nan_like((t, h), dtype), residual_out=nan_like((t, h), dtype)
    )
    ref_normed, ref_residual = reference_elementwise.fused_add_rms_norm(x, residual, weight, EPS)
    assert_matches(new_residual, ref_residual)
    assert_matches(normed, ref_normed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"


def run_rotary(t: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int, fused_qkv: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    max_positions = 4096
    cos, sin = rope_tables(max_positions, d)
    positions = torch.randint(0, max_positions, (t,), generator=gen).to(DEVICE)  # unsorted
    if fused_qkv:  # q and k are strided views of one [T, (Hq + 2 Hk) D] projection output
        qkv = randn(t, (hq + 2 * hk) * d, dtype=dtype, gen=gen, scale=2.0)
        query = qkv[:, : hq * d].view(t, hq, d)
        key = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    else:
        query = randn(t, hq, d, dtype=dtype, gen=gen, scale=2.0)
        key = randn(t, hk, d, dtype=dtype, gen=gen, scale=2.0)
    q_before, k_before = query.clone(), key.clone()
    q_out, k_out = elementwise_triton.rotary_embedding(
        positions, query, key, cos, sin, q_out=nan_like((t, hq, d), dtype), k_out=nan_like((t, hk, d), dtype)
    )
    ref_q, ref_k = reference_elementwise.rotary_embedding(positions, query, key, cos, sin)
    assert_matches(q_out, ref_q)
    assert_matches(k_out, ref_k)
    assert torch.equal(query, q_before) and torch.equal(key, k_before), "inputs were modified"


def run_qk_norm_rotary(
    t: int,
    hq: int,
    hk: int,
    d: int,
    dtype: torch.dtype,
    seed: int,
    weight_dtype: torch.dtype | None = None,
    against_launches: bool = False,
) -> None:
    """The fused per-head RMSNorm + rotary of q and k (strided views into one fused qkv tensor)
    against the reference norms then the reference rotary; with ``against_launches`` also against
    the three launches it replaces (``rms_norm`` of q, of k, then ``rotary_embedding``). Rows are
    ``positions + table * max_positions`` over two tables, as ``RotaryEmbedding`` gathers Qwen v1's
    NTK tables, so some tokens read past the first table."""
    gen = torch.Generator().manual_seed(seed)
    max_positions = 4096
    cos, sin = rope_tables(2 * max_positions, d)  # [2 tables * max_positions, D / 2]
    positions = torch.randint(0, max_positions, (t,), generator=gen)  # unsorted
    rows = (positions + (torch.arange(t) % 2) * max_positions).to(DEVICE)  # [T]: odd tokens in table 1
    qkv = randn(t, (hq + 2 * hk) * d, dtype=dtype, gen=gen, scale=3.0)  # [T, (Hq + 2 Hk) D]
    query = qkv[:, : hq * d].view(t, hq, d)
    key = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    q_weight = randn(d, dtype=weight_dtype or dtype, gen=gen)  # [D]
    k_weight = randn(d, dtype=weight_dtype or dtype, gen=gen)
    out_dtype = torch.promote_types(dtype, q_weight.dtype)  # rms_norm's promotion
    q_before, k_before = query.clone(), key.clone()
    q_out, k_out = elementwise_triton.qk_norm_rotary_embedding(
        rows, query, key, q_weight, k_weight, EPS, cos, sin,
        q_out=nan_like((t, hq, d), out_dtype), k_out=nan_like((t, hk, d), out_dtype),
    )  # fmt: skip
    ref_q, ref_k = reference_elementwise.rotary_embedding(
        rows,
        reference_elementwise.rms_norm(query, q_weight, EPS),
        reference_elementwise.rms_norm(key, k_weight, EPS),
        cos,
        sin,
    )
    assert_matches(q_out, ref_q)
    assert_matches(k_out, ref_k)
    assert torch.equal(query, q_before) and torch.equal(key, k_before), "inputs were modified"
    if against_launches:
        q_normed = elementwise_triton.rms_norm(query, q_weight, EPS)  # [T, Hq, D]
        k_normed = elementwise_triton.rms_norm(key, k_weight, EPS)  # [T, Hk, D]
        launched_q, launched_k = elementwise_triton.rotary_embedding(rows, q_normed, k_normed, cos, sin)
        assert_matches(q_out, launched_q)
        assert_matches(k_out, launched_k)


def run_rotary_kv_store(
    t: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int, qk_norm: bool, against_launches: bool = False
) -> None:
    """``QSERVE_FUSED_ROPE_KV_STORE``'s launch (``rotary_kernel`` with ``STORE_KV``, with and without
    ``QK_NORM``): q and k as without a store (bitwise: the same launch's outputs), and the rotated keys
    and the values in the cache where ``reference.store_kv`` puts them, every other cache row untouched;
    pad rows (slot -1) store nothing. q, k and v are strided views of one fused qkv tensor, the slots
    unsorted and spread over several blocks. With ``against_launches``: the caches equal those of the
    two launches it replaces (the rotary, then ``attention_triton.store_kv``)."""
    from quant_kernels import reference
    from quant_kernels.kv_store import KVStore

    gen = torch.Generator().manual_seed(seed)
    max_positions, block_size = 4096, 16
    cos, sin = rope_tables(max_positions, d)
    positions = torch.randint(0, max_positions, (t,), generator=gen).to(DEVICE)  # unsorted
    qkv = randn(t, (hq + 2 * hk) * d, dtype=dtype, gen=gen, scale=3.0)  # [T, (Hq + 2 Hk) D]
    query, key, value = (
        part.view(t, n, d) for part, n in zip(qkv.split([hq * d, hk * d, hk * d], dim=-1), (hq, hk, hk))
    )
    num_blocks = t // block_size + 3
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]  # [T], unsorted, distinct
    slots[::3] = -1  # pad rows
    slots = slots.to(DEVICE)
    caches = [
        randn(num_blocks, block_size, hk, d, dtype=dtype, gen=gen) for _ in range(2)
    ]  # not zero: untouched rows show
    want_caches = [cache.clone() for cache in caches]
    store = KVStore(value, caches[0], caches[1], slots)
    if qk_norm:
        weights = (randn(d, dtype=dtype, gen=gen), randn(d, dtype=dtype, gen=gen), EPS)
        got = elementwise_triton.qk_norm_rotary_embedding(positions, query, key, *weights, cos, sin, kv_store=store)
        plain = elementwise_triton.qk_norm_rotary_embedding(positions, query, key, *weights, cos, sin)
    else:
        got = elementwise_triton.rotary_embedding(positions, query, key, cos, sin, kv_store=store)
        plain = elementwise_triton.rotary_embedding(positions, query, key, cos, sin)
    assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])
    reference.store_kv(plain[1], value, want_caches[0], want_caches[1], slots)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
    if against_launches:
        from quant_kernels import attention_triton

        launched = [cache.clone() for cache in want_caches]
        attention_triton.store_kv(plain[1], value, launched[0], launched[1], slots)
        assert torch.equal(caches[0], launched[0]) and torch.equal(caches[1], launched[1])


def run_silu_and_mul(t: int, inter: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gate_up = randn(t, 2 * inter, dtype=dtype, gen=gen, scale=3.0)  # [T, 2I]
    out = elementwise_triton.silu_and_mul(gate_up, out=nan_like((t, inter), dtype))
    assert_matches(out, reference_elementwise.silu_and_mul(gate_up))


# ----------------------------------------------------------------------------------------------
# Interpreter (and GPU): small shapes, the full dtype x T grid
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", [40, 200])
def test_rms_norm(t, h, dtype) -> None:
    run_rms_norm(t, h, dtype, seed=t * 1000 + h)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("h", [40, 200])
def test_fused_add_rms_norm(t, h, dtype) -> None:
    run_fused_add_rms_norm(t, h, dtype, seed=t * 1000 + h)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hq,hk,d", [(4, 2, 16), (6, 2, 40), (3, 3, 64)])  # D/2 = 20: masked half
def test_rotary(t, hq, hk, d, dtype) -> None:
    run_rotary(t, hq, hk, d, dtype, seed=t * 1000 + d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rotary_contiguous_inputs(dtype) -> None:
    run_rotary(5, 4, 2, 32, dtype, seed=7, fused_qkv=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("hq,hk,d", [(32, 4, 128), (32, 4, 64), (6, 2, 40)])  # Qwen3's GQA; D/2 = 20: masked
def test_qk_norm_rotary(t, hq, hk, d, dtype) -> None:
    run_qk_norm_rotary(t, hq, hk, d, dtype, seed=t * 1000 + d)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", [0, 1, 7])
@pytest.mark.parametrize("hq,hk,d", [(8, 2, 64), (6, 2, 40)])  # D/2 = 20: masked half
def test_rotary_kv_store(t, hq, hk, d, dtype, qk_norm) -> None:
    run_rotary_kv_store(t, hq, hk, d, dtype, seed=t + d, qk_norm=qk_norm)


def test_qk_norm_rotary_float32_weight() -> None:
    """A float32 norm weight on fp16 activations gives float32 outputs, as ``rms_norm`` does."""
    run_qk_norm_rotary(3, 6, 2, 32, torch.float16, seed=9, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("inter", [40, 1500])  # 1500: two column blocks, the second partial
def test_silu_and_mul(t, inter, dtype) -> None:
    run_silu_and_mul(t, inter, dtype, seed=t * 1000 + inter)


def test_rms_norm_hidden_5120() -> None:
    run_rms_norm(3, 5120, torch.float16, seed=1)
    run_fused_add_rms_norm(3, 5120, torch.bfloat16, seed=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_head_view(dtype) -> None:
    """Qwen3's q norm: ``[T, heads, D]`` view into a fused qkv tensor (rows not evenly strided)."""
    gen = torch.Generator().manual_seed(3)
    t, heads, d = 5, 6, 24
    qkv = randn(t, heads * d + 2 * 2 * d, dtype=dtype, gen=gen)  # [T, (Hq + 2 Hk) D]
    q = qkv[:, : heads * d].view(t, heads, d)
    weight = randn(d, dtype=dtype, gen=gen)
    out = elementwise_triton.rms_norm(q, weight, EPS, out=nan_like((t, heads, d), dtype))
    assert_matches(out, reference_elementwise.rms_norm(q, weight, EPS))


def test_rms_norm_other_layouts() -> None:
    """Inputs the kernel cannot address in place (4-D, transposed, last stride != 1) and a
    float32 weight on fp16 activations (the result is float32, as in torch)."""
    gen = torch.Generator().manual_seed(4)
    x4 = randn(2, 3, 2, 40, dtype=torch.float16, gen=gen)[:, :, :1]  # [2, 3, 1, 40], non-contiguous
    weight = randn(40, dtype=torch.float16, gen=gen)
    assert_matches(elementwise_triton.rms_norm(x4, weight, EPS), reference_elementwise.rms_norm(x4, weight, EPS))
    xt = randn(40, 7, dtype=torch.bfloat16, gen=gen).t()  # [7, 40], last stride 7
    w_bf16 = weight.to(torch.bfloat16)
    assert_matches(elementwise_triton.rms_norm(xt, w_bf16, EPS), reference_elementwise.rms_norm(xt, w_bf16, EPS))
    x1 = randn(40, dtype=torch.float16, gen=gen)  # [H]
    assert_matches(elementwise_triton.rms_norm(x1, weight, EPS), reference_elementwise.rms_norm(x1, weight, EPS))
    x2 = randn(3, 40, dtype=torch.float16, gen=gen)
    w32 = weight.float()
    out = elementwise_triton.rms_norm(x2, w32, EPS)
    assert out.dtype == torch.float32
    assert_matches(out, reference_elementwise.rms_norm(x2, w32, EPS))


def test_empty_inputs_return_empty() -> None:
    h, d = 40, 16
    empty = torch.empty(0, h, dtype=torch.float16, device=DEVICE)
    weight = torch.ones(h, dtype=torch.float16, device=DEVICE)
    assert elementwise_triton.rms_norm(empty, weight, EPS).shape == (0, h)
    normed, residual = elementwise_triton.fused_add_rms_norm(empty, empty, weight, EPS)
    assert normed.shape == residual.shape == (0, h)
    cos, sin = rope_tables(8, d)
    positions = torch.empty(0, dtype=torch.int64, device=DEVICE)
    q, k = elementwise_triton.rotary_embedding(
        positions, empty.view(0, 2, 20)[..., :d], empty.view(0, 2, 20)[:, :1, :d], cos, sin
    )
    assert q.shape == (0, 2, d) and k.shape == (0, 1, d)
    assert elementwise_triton.silu_and_mul(empty).shape == (0, h // 2)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def test_ops_use_reference_on_cpu() -> None:
    """Off CUDA every op is exactly the reference (the CPU path of the engine)."""
    gen = torch.Generator().manual_seed(5)
    t, hq, hk, d, h = 3, 4, 2, 16, 40
    x = torch.randn(t, h, generator=gen).half()
    residual = torch.randn(t, h, generator=gen).half()
    weight = torch.randn(h, generator=gen).half()
    assert torch.equal(elementwise_ops.rms_norm(x, weight, EPS), reference_elementwise.rms_norm(x, weight, EPS))
    got = elementwise_ops.fused_add_rms_norm(x, residual, weight, EPS)
    want = reference_elementwise.fused_add_rms_norm(x, residual, weight, EPS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).bfloat16()
    query, key = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    positions = torch.tensor([5, 0, 3])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(8, dtype=torch.float32), inv_freq)
    got = elementwise_ops.rotary_embedding(positions, query, key, freqs.cos(), freqs.sin())
    want = reference_elementwise.rotary_embedding(positions, query, key, freqs.cos(), freqs.sin())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    gate_up = torch.randn(t, 2 * h, generator=gen).half()
    assert torch.equal(elementwise_ops.silu_and_mul(gate_up), reference_elementwise.silu_and_mul(gate_up))


def test_qk_norm_rotary_uses_reference_on_cpu() -> None:
    """Off CUDA the fused op is exactly the reference norms then the reference rotary (the ops the
    decoder ran before the fusion), bit for bit."""
    gen = torch.Generator().manual_seed(10)
    t, hq, hk, d = 3, 4, 2, 16
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).bfloat16()
    query, key = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    q_weight, k_weight = torch.randn(d, generator=gen).bfloat16(), torch.randn(d, generator=gen).bfloat16()
    cos, sin = rope_tables(8, d)
    positions = torch.tensor([5, 0, 3])
    got = elementwise_ops.qk_norm_rotary_embedding(positions, query, key, q_weight, k_weight, EPS, cos.cpu(), sin.cpu())
    want = reference_elementwise.rotary_embedding(
        positions,
        reference_elementwise.rms_norm(query, q_weight, EPS),
        reference_elementwise.rms_norm(key, k_weight, EPS),
        cos.cpu(),
        sin.cpu(),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_reference_matches_previous_layers() -> None:
    """The reference keeps the arithmetic the layers used before the fused ops (HF Llama)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 40, generator=gen).bfloat16()
    weight = torch.randn(40, generator=gen).bfloat16()
    x_float = x.float()
    x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(reference_elementwise.rms_norm(x, weight, EPS), weight * x_float.to(x.dtype))
    gate_up = torch.randn(3, 80, generator=gen).half()
    gate, up = gate_up.split(40, dim=-1)
    assert torch.equal(reference_elementwise.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)


def test_ops_import_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from quant_kernels import elementwise_ops\n"
        "x = torch.randn(2, 8)\n"
        "assert elementwise_ops.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)\n"
        "assert elementwise_ops.silu_and_mul(x).shape == (2, 4)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ----------------------------------------------------------------------------------------------
# GPU: Qwen2.5-14B sizes (H=5120, Hq=40, Hk=8, D=128, I=13824), dispatch and CUDA graphs
# ----------------------------------------------------------------------------------------------

GPU_TOKENS = [1, 2, 7, 16, 64, 257, 1024]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t", GPU_TOKENS)
def test_gpu_real_sizes(t, dtype) -> None:
    run_rms_norm(t, 5120, dtype, seed=t)
    run_fused_add_rms_norm(t, 5120, dtype, seed=t + 1)
    run_rotary(t, 40, 8, 128, dtype, seed=t + 2)
    run_rotary(t, 28, 4, 128, dtype, seed=t + 3, fused_qkv=False)
    run_silu_and_mul(t, 13824, dtype, seed=t + 4)
    run_rms_norm(t, 3584, dtype, seed=t + 5)  # Qwen2.5-7B: H not a power of two times 1024


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_qk_norm_view() -> None:
    """Qwen3-style per-head norm on a strided view, at real sizes."""
    gen = torch.Generator().manual_seed(8)
    t, hq, hk, d = 33, 40, 8, 128
    qkv = randn(t, (hq + 2 * hk) * d, dtype=torch.bfloat16, gen=gen)
    for view in (qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)):
        weight = randn(d, dtype=torch.bfloat16, gen=gen)
        assert_matches(elementwise_ops.rms_norm(view, weight, EPS), reference_elementwise.rms_norm(view, weight, EPS))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", [1, 37])
def test_gpu_qk_norm_rotary_qwen3_30b_a3b(t, dtype) -> None:
    """QSERVE_FUSED_QK_NORM_ROPE's one launch at Qwen3-30B-A3B's attention (32 q heads, 4 kv heads,
    D = 128; a batch-1 decode and a short prefill) against the reference and against the q_norm,
    k_norm and rotary launches it replaces."""
    run_qk_norm_rotary(t, 32, 4, 128, dtype, seed=t + 11, against_launches=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rotary", "qk-norm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", [1, 37, 300])
def test_gpu_rotary_kv_store(t, dtype, qk_norm) -> None:
    """QSERVE_FUSED_ROPE_KV_STORE's launch at Qwen3-30B-A3B's attention (32 q / 4 kv heads, D = 128) and
    Qwen2.5-14B's (40 / 8): the caches equal those of the rotary then ``store_kv`` launches."""
    for hq, hk in ((32, 4), (40, 8)):
        run_rotary_kv_store(t, hq, hk, 128, dtype, seed=t + hq, qk_norm=qk_norm, against_launches=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_ops_under_cuda_graph() -> None:
    """``elementwise_ops`` dispatches to Triton on CUDA and replays correctly in a CUDA graph."""
    t, h, hq, hk, d, inter = 16, 5120, 40, 8, 128, 13824
    dtype = torch.float16
    cos, sin = rope_tables(4096, d)
    x = torch.empty(t, h, dtype=dtype, device="cuda")
    residual = torch.empty(t, h, dtype=dtype, device="cuda")
    weight = torch.randn(h, dtype=dtype, device="cuda")
    qkv = torch.empty(t, (hq + 2 * hk) * d, dtype=dtype, device="cuda")
    query, key = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    positions = torch.zeros(t, dtype=torch.int64, device="cuda")
    gate_up = torch.empty(t, 2 * inter, dtype=dtype, device="cuda")

    def step() -> tuple[torch.Tensor, ...]:
        normed, new_residual = elementwise_ops.fused_add_rms_norm(x, residual, weight, EPS)
        q, k = elementwise_ops.rotary_embedding(positions, query, key, cos, sin)
        return (
            elementwise_ops.rms_norm(x, weight, EPS),
            normed,
            new_residual,
            q,
            k,
            elementwise_ops.silu_and_mul(gate_up),
        )

    for tensor in (x, residual, qkv, gate_up):
        tensor.normal_()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        for tensor in (x, residual, qkv, gate_up):
            tensor.normal_()
        positions.copy_(torch.randint(0, 4096, (t,), device="cuda"))
        graph.replay()
        want = (
            reference_elementwise.rms_norm(x, weight, EPS),
            *reference_elementwise.fused_add_rms_norm(x, residual, weight, EPS),
            *reference_elementwise.rotary_embedding(positions, query, key, cos, sin),
            reference_elementwise.silu_and_mul(gate_up),
        )
        for got, ref in zip(outs, want):
            assert_matches(got, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is the CPU path")
def test_triton_language_itself_is_interpreted():
    """``tl.cdiv`` and the other ``triton.language`` helpers were defined under TRITON_INTERPRET:
    when something imported triton before it was set, every kernel calling them failed."""
    triton = pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton.language.cdiv, InterpretedFunction), type(triton.language.cdiv)
