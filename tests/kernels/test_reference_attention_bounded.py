"""The reference paged attention (the CPU engine's attention and every kernel's oracle) holds
bounded memory: a step whose padded scores would be huge runs in groups of sequences and slices
of a long prompt's rows, with results identical to the one-call math (the audit of 2026-12-05 saw
~4.9 GB on the CPU for 256 prompts sharing a cached prefix)."""

from __future__ import annotations

import pytest
import torch

from quant_kernels import reference


def _case(seed: int, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8, block_size: int = 4):
    gen = torch.Generator().manual_seed(seed)
    # (context after the step, new tokens): decodes, a whole prefill, an extend over a cached prefix
    shapes = [(9, 1), (23, 23), (40, 17), (5, 1), (31, 2), (64, 64)]
    num_blocks = sum(-(-ctx // block_size) for ctx, _ in shapes) + 1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    max_blocks = max(-(-ctx // block_size) for ctx, _ in shapes)
    tables = torch.zeros(len(shapes), max_blocks, dtype=torch.int32)
    free = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 never used: a stray read shows
    used = 0
    for seq, (ctx, _) in enumerate(shapes):
        n = -(-ctx // block_size)
        tables[seq, :n] = free[used : used + n]
        used += n
    q_lens = torch.tensor([q for _, q in shapes])
    query_start_loc = torch.zeros(len(shapes) + 1, dtype=torch.int32)
    query_start_loc[1:] = q_lens.cumsum(0)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen)
    seq_lens = torch.tensor([ctx for ctx, _ in shapes], dtype=torch.int32)
    return (query, key_cache, value_cache, tables, seq_lens, query_start_loc, int(q_lens.max()), int(seq_lens.max()))


@pytest.mark.parametrize("budget", [1, 20_000, 60_000], ids=["one-row-at-a-time", "slices", "groups"])
@pytest.mark.parametrize(
    ("window", "alibi"), [(None, False), (7, False), (None, True)], ids=["causal", "window", "alibi"]
)
def test_bounded_reference_equals_the_one_call_math(budget, window, alibi, monkeypatch):
    args = _case(seed=budget)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    whole = reference.paged_attention(*args, 0.3, window, alibi_slopes=slopes)

    calls = []
    padded = reference._padded_paged_attention

    def counted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(a[0].shape[0])
        return padded(*a, **k)

    monkeypatch.setattr(reference, "REFERENCE_ATTENTION_BYTES", budget)
    monkeypatch.setattr(reference, "_padded_paged_attention", counted)
    bounded = reference.paged_attention(*args, 0.3, window, alibi_slopes=slopes)
    assert len(calls) > 2, "the budget did not split the step: the test proves nothing"
    assert sum(calls) == args[0].shape[0]  # every query row exactly once
    torch.testing.assert_close(bounded, whole, atol=1e-5, rtol=1e-5)
