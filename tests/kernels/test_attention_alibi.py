"""ALiBi (Baichuan2-13B) in the Triton paged-attention kernels against the PyTorch reference.

Decode (split and unsplit, byte-wise and 4-codes-a-word fp8 reads), prefill, extend over a
cached prefix and mixed batches, with power-of-two and non-power-of-two head counts (5, 6, 40:
the second slope series) and GQA. On CPU the kernels run through TRITON_INTERPRET=1
(conftest.py) at tiny sizes; the ``gpu`` case runs at a real size. Fresh random inputs per case,
NaN-poisoned outputs, explicit per-dtype tolerances (``test_attention.assert_matches``).
"""

from __future__ import annotations

import pytest
import torch

from qserve.layers.attention import alibi_slopes
from quant_kernels import reference_kv_quant
from tests.kernels.test_attention import DEVICE, SMALL, SMALL_BYTES, Case, assert_matches, make_batch

triton = pytest.importorskip("triton")

from quant_kernels import attention_triton  # noqa: E402

CASES = [
    Case((1, 1), (37, 5), num_heads=5, num_kv_heads=5, config=SMALL),  # decode, split KV, 5 heads
    Case((1,), (21,), num_heads=6, num_kv_heads=3, num_splits=1, config=SMALL),  # decode unsplit, GQA
    Case((9,), (9,), num_heads=5, num_kv_heads=5, config=SMALL),  # prefill
    Case((6, 1, 3), (22, 17, 3), num_heads=8, num_kv_heads=2, config=SMALL),  # extend + decode + prefill
    Case((1, 1), (40, 7), num_heads=6, num_kv_heads=6, cache="fp8", config=SMALL),  # packed fp8 decode
    Case((4, 1), (20, 30), num_heads=5, num_kv_heads=5, cache="int8", config=SMALL_BYTES),
]


def _run(case: Case, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    b = make_batch(case, gen)
    reference_kv_quant.store_kv(b.key, b.value, b.key_cache, b.value_cache, b.slot_mapping, b.k_scale, b.v_scale)
    slopes = alibi_slopes(case.num_heads).to(b.query.device)
    args = (
        b.query,
        b.key_cache,
        b.value_cache,
        b.block_tables,
        b.seq_lens,
        b.query_start_loc,
        max(case.query_lens),
        max(case.seq_lens),
        case.head_dim**-0.5,
        case.window,
        b.k_scale,
        b.v_scale,
    )
    ref = reference_kv_quant.paged_attention(*args, alibi_slopes=slopes).float()
    plain = reference_kv_quant.paged_attention(*args).float()
    assert (ref - plain).abs().max() > 1e-2, "ALiBi must change the result for this case to test anything"
    out = torch.full_like(b.query, float("nan"))
    attention_triton.paged_attention(
        *args, out=out, num_splits=case.num_splits, config=case.config, alibi_slopes=slopes
    )
    assert_matches(out, ref, case.dtype)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c.query_lens}-s{c.seq_lens}-h{c.num_heads}-{c.cache}")
def test_alibi_kernels_match_reference(case):
    if DEVICE == "cpu" and case.cache == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no fp8 dtype")
    _run(case, seed=hash(case.query_lens) % 1000)


def test_reference_alibi_is_relative_distance():
    """The reference adds slope * (j - i); HF Baichuan adds slope * j: softmax-equal per row."""
    gen = torch.Generator().manual_seed(0)
    case = Case((7,), (7,), num_heads=5, num_kv_heads=5, dtype=torch.float32)
    b = make_batch(case, gen, device="cpu")
    reference_kv_quant.store_kv(b.key, b.value, b.key_cache, b.value_cache, b.slot_mapping, None, None)
    slopes = alibi_slopes(5)
    out = reference_kv_quant.paged_attention(
        b.query,
        b.key_cache,
        b.value_cache,
        b.block_tables,
        b.seq_lens,
        b.query_start_loc,
        7,
        7,
        0.125,
        alibi_slopes=slopes,
    )
    keys, values = b.key, b.value  # [7, 5, 64]: the whole sequence is this step's tokens
    scores = torch.einsum("qhd,khd->hqk", b.query.float(), keys.float()) * 0.125
    scores = scores + slopes.view(5, 1, 1) * torch.arange(7).float().view(1, 1, 7)  # slope * j
    scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float())
    torch.testing.assert_close(out.float(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["auto", "fp8", "int8"])
def test_alibi_kernels_real_size(cache):
    _run(
        Case((1,) * 8 + (300, 77), (700,) * 8 + (300, 900), num_heads=40, num_kv_heads=40, head_dim=128, cache=cache), 1
    )
