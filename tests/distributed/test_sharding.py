"""Unit tests of the tensor-parallel partition and weight slicing (no processes): exact slices
of dense and packed weights, the act-order row-parallel shard (padded groups, full scales),
the group-alignment refusal, head / vocabulary partitions and the per-rank memory plan."""

from __future__ import annotations

import json

import pytest
import torch

from qserve.distributed.sharding import (
    attention_shard,
    column_shard,
    per_rank_config,
    row_shard,
    row_shard_act_order,
    vocab_shard,
)
from qserve.memory.planner import make_plan, weight_bytes
from qserve.model.registry import read_model_config
from quant_kernels import reference
from quant_kernels.layout import PackedQuantWeight, pack_codes
from tests.helpers.quant_packers import tiny_llama_config


def packed(
    k: int, n: int, bits: int = 4, group: int = 32, *, sym: bool = False, act_order: bool = False, seed: int = 0
):
    gen = torch.Generator().manual_seed(seed)
    ng = -(-k // group)
    codes = torch.randint(0, 1 << bits, (k, n), generator=gen)  # [K, N]
    scales = (torch.rand(ng, n, generator=gen) * 0.1 + 0.01).to(torch.float16)  # [ng, N]
    zeros = None if sym else torch.randint(0, 1 << bits, (ng, n), generator=gen).to(torch.uint8)
    perm = None
    if act_order:  # groups of a shuffled g_idx, rows sorted by group as the loaders do
        g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=gen)]
        perm = torch.argsort(g_idx, stable=True)
    return PackedQuantWeight(bits, group, pack_codes(codes, bits), scales, zeros, perm)


def test_column_shard_is_a_plain_slice_along_n() -> None:
    dense = torch.randn(48, 16)  # [N, K]
    assert torch.equal(column_shard(dense, 8, 24, 48, "x"), dense[8:32])
    w = packed(64, 48, act_order=True)
    shard = column_shard(w, 8, 24, 48, "x")
    assert torch.equal(shard.qweight, w.qweight[:, 8:32])
    assert torch.equal(shard.scales, w.scales[:, 8:32]) and torch.equal(shard.zeros, w.zeros[:, 8:32])
    assert shard.perm is w.perm and shard.group_size == w.group_size
    with pytest.raises(ValueError, match="N=48 outputs, the config says 40"):
        column_shard(w, 0, 20, 40, "x")


def test_row_shard_dense_and_grouped_packed_are_exact_slices() -> None:
    dense = torch.randn(16, 64)  # [N, K]
    assert torch.equal(row_shard(dense, 1, 2, 64, "x"), dense[:, 32:])
    w = packed(128, 16, group=32)
    full = reference.dequantize(w)  # [K, N]
    for rank in range(2):
        shard = row_shard(w, rank, 2, 128, "x")
        assert torch.equal(shard.qweight, w.qweight[rank * 8 : (rank + 1) * 8])  # 64 rows / 8 per word
        assert torch.equal(shard.scales, w.scales[rank * 2 : (rank + 1) * 2])
        assert torch.equal(reference.dequantize(shard), full[rank * 64 : (rank + 1) * 64])


def test_row_shard_per_channel_keeps_its_one_scale_row() -> None:
    w = packed(64, 8, group=64, sym=True)
    shard = row_shard(w, 1, 2, 64, "x")
    assert shard.group_size == 32 and torch.equal(shard.scales, w.scales)
    assert torch.equal(reference.dequantize(shard), reference.dequantize(w)[32:])


def test_row_shard_refuses_groups_straddling_ranks() -> None:
    w = packed(96, 8, group=32)
    with pytest.raises(ValueError) as err:
        row_shard(w, 0, 2, 96, "model.layers.0.mlp.down_proj")
    message = str(err.value)
    for part in ("model.layers.0.mlp.down_proj", "K=96", "tensor_parallel_size=2", "group size 32"):
        assert part in message


@pytest.mark.parametrize("bits,sym", [(4, False), (4, True), (8, False)])
@pytest.mark.parametrize("size", [2, 4])
def test_row_shard_act_order_is_exact(bits, sym, size) -> None:
    k, n, group = 256, 24, 32
    w = packed(k, n, bits, group, sym=sym, act_order=True, seed=size)
    full_input_order = reference.dequantize_input_order(w, torch.float32)  # [K, N]
    x = torch.randn(5, k, dtype=torch.float64)  # float64: the split sum equals the full product to 1e-12
    want = reference.w4a16_matmul(x, w)  # [5, N]
    total = torch.zeros_like(want)
    k_local = k // size
    for rank in range(size):
        shard = row_shard(w, rank, size, k, "o_proj")
        assert shard.scales is w.scales and shard.zeros is w.zeros  # groups are global: full, shared
        assert shard.group_size % 16 == 0 and shard.num_groups == w.num_groups
        assert int(shard.perm.max()) < k_local
        # Every real row dequantizes exactly as in the full weight; padding rows are exactly 0.
        rows = torch.zeros(k_local, n).index_add_(0, shard.perm, reference.dequantize(shard, torch.float32))
        assert torch.equal(rows, full_input_order[rank * k_local : (rank + 1) * k_local])
        total += reference.w4a16_matmul(x[:, rank * k_local : (rank + 1) * k_local], shard)
    torch.testing.assert_close(total, want, atol=1e-12, rtol=1e-12)


def test_row_shard_act_order_needs_no_group_alignment() -> None:
    w = packed(96, 8, group=32, act_order=True)  # 48 rows per rank: not a multiple of 32
    shard = row_shard_act_order(w, 1, 2, "x")
    rows = torch.zeros(48, 8).index_add_(0, shard.perm, reference.dequantize(shard, torch.float32))
    assert torch.equal(rows, reference.dequantize_input_order(w, torch.float32)[48:])


def test_attention_shard_splits_or_replicates_kv_heads() -> None:
    shard = attention_shard(8, 4, 1, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.q_head_start, shard.kv_head_start) == (4, 2, 4, 2)
    # 2 KV heads over 4 ranks: rank r uses KV head r // 2, and its query heads are in that group.
    assert [attention_shard(8, 2, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert all(attention_shard(8, 2, r, 4).num_kv_heads == 1 for r in range(4))
    assert attention_shard(4, 1, 1, 2).qkv_slices(16) == [(32, 32), (0, 16), (0, 16)]
    with pytest.raises(ValueError, match="num_key_value_heads=3 < tensor_parallel_size=4"):
        attention_shard(12, 3, 0, 4)
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by tensor_parallel_size=4"):
        attention_shard(6, 2, 0, 4)


def test_vocab_shard_pads_the_last_rank() -> None:
    assert vocab_shard(401, 0, 2) == (0, 201, 201)
    assert vocab_shard(401, 1, 2) == (201, 200, 201)


def test_planner_is_per_rank(tmp_path) -> None:
    raw = tiny_llama_config(hidden_size=128, intermediate_size=256, vocab_size=400)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = read_model_config(tmp_path)
    rank = per_rank_config(config, 2)
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (2, 1, 128)
    one, two = weight_bytes(config, None, torch.float16), weight_bytes(config, None, torch.float16, 2)
    replicated_norms = (2 * config.num_layers + 1) * config.hidden_size * 2
    rotary_tables = config.max_position_embeddings * config.head_dim * 4  # float32 cos / sin, on every rank
    assert 2 * two - one == replicated_norms + rotary_tables  # everything else is split exactly in two
    plans = [
        make_plan(config, weights_bytes=w, budget_bytes=1 << 30, dtype=torch.float16, tensor_parallel_size=tp)
        for w, tp in ((one, 1), (two, 2))
    ]
    assert plans[1].kv_bytes_per_token * 2 == plans[0].kv_bytes_per_token
