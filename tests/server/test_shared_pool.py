"""The shared page pool: page size, budget arithmetic, shares, and strided per-model views."""

from __future__ import annotations

import pytest
import torch

from qserve.memory.shared_pool import ModelKVSpec, SharedKVPool, num_pages_for, page_bytes_for
from qserve.model.registry import read_model_config
from qserve.scheduler.block_pool import BlockPool
from qserve.scheduler.kv_cache_manager import KVCacheManager


@pytest.fixture(scope="module")
def specs(checkpoints) -> list[ModelKVSpec]:
    llama = read_model_config(checkpoints["llama"])  # 2 layers, 2 KV heads, head_dim 16
    qwen = read_model_config(checkpoints["qwen"])  # 3 layers, 1 KV head, head_dim 16
    return [
        ModelKVSpec("llama", llama, torch.float32, 16, 64, 2),
        ModelKVSpec("qwen", qwen, torch.float16, 16, 64, 2),
    ]


def test_page_holds_the_largest_block(specs):
    llama, qwen = specs
    assert llama.block_bytes == 2 * 2 * 16 * 2 * 16 * 4
    assert qwen.block_bytes == 2 * 3 * 16 * 1 * 16 * 2
    assert page_bytes_for(specs) == llama.block_bytes


def test_budget_to_pages(specs):
    page = page_bytes_for(specs)
    assert num_pages_for(specs, 10 * page + 7) == 10
    assert num_pages_for(specs, 10**9) == sum(s.useful_pages for s in specs)  # capped by what could be used
    with pytest.raises(ValueError, match="max_model_len"):
        num_pages_for(specs, 3 * page)  # one 64-token sequence needs 4 pages


def test_views_write_into_their_own_bytes(specs):
    pool = SharedKVPool(specs, 6, "cpu")
    llama, qwen = pool.kv_caches("llama"), pool.kv_caches("qwen")
    assert len(llama) == 2 and len(qwen) == 3
    assert llama[0][0].shape == (6, 16, 2, 16) and llama[0][0].dtype == torch.float32
    assert qwen[2][1].shape == (6, 16, 1, 16) and qwen[2][1].dtype == torch.float16
    # Every view of one model covers disjoint bytes of a page.
    for caches in (llama, qwen):
        pool.buffer.zero_()
        for i, (key, value) in enumerate(caches):
            key[4] = 2 * i + 1
            value[4] = 2 * i + 2
        for i, (key, value) in enumerate(caches):
            assert torch.all(key[4] == 2 * i + 1) and torch.all(value[4] == 2 * i + 2)
        assert torch.count_nonzero(pool.buffer[[0, 1, 2, 3, 5]]) == 0  # other pages untouched


def test_shares_and_owner_accounting(specs):
    pool = SharedKVPool(specs, 10, "cpu", min_shares={"qwen": 0.3}, max_shares={"llama": 0.6})
    blocks: BlockPool = pool.block_pool
    assert blocks.share("qwen").min_blocks == 3 and blocks.share("llama").max_blocks == 6
    llama = KVCacheManager(blocks, 16, owner="llama")
    qwen = KVCacheManager(blocks, 16, owner="qwen")
    assert llama.max_num_blocks == 6 and qwen.max_num_blocks == 10
    assert blocks.allocate(7, "llama") is None
    assert blocks.allocate(6, "llama") is not None
    assert blocks.num_available("qwen") == 4
    assert blocks.allocate(4, "qwen") is not None
    assert blocks.num_used_by("llama") == 6 and blocks.num_used_by("qwen") == 4


def test_bad_shares(specs):
    with pytest.raises(ValueError, match="unknown model"):
        SharedKVPool(specs, 10, "cpu", min_shares={"mystery": 0.1})
    with pytest.raises(ValueError, match="below"):
        SharedKVPool(specs, 10, "cpu", min_shares={"qwen": 0.5}, max_shares={"qwen": 0.2})
    with pytest.raises(ValueError, match="minimum shares"):
        SharedKVPool(specs, 10, "cpu", min_shares={"qwen": 0.7, "llama": 0.7})
