"""``kv_cache_dtype="int4"`` through the engine on CPU (the reference path): cache layout, the shared
page pool, and outputs close to the model-dtype cache."""

from __future__ import annotations

import math

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.memory.shared_pool import ModelKVSpec, SharedKVPool, page_bytes_for
from qserve.model.registry import read_model_config

PROMPTS = [{"prompt_token_ids": list(range(5, 60))}, {"prompt_token_ids": [9, 8, 7] * 20}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)


def prompt_logprobs(outputs) -> torch.Tensor:
    values = []
    for output in outputs:
        ids = output.prompt_token_ids
        values += [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return torch.tensor(values)


@pytest.fixture(scope="module")
def llama_path(tiny_checkpoints) -> str:
    return tiny_checkpoints["LlamaForCausalLM"][1]


def test_int4_kv_cache_layout_and_outputs_close_to_model_dtype(llama_path):
    baseline = prompt_logprobs(LLM(llama_path, device="cpu", dtype="float32").generate(PROMPTS, PARAMS))
    llm = LLM(llama_path, device="cpu", dtype="float32", kv_cache_dtype="int4")
    config = llm.engine.model_config
    key_cache, value_cache = llm.engine.runner.kv_caches[0]
    assert key_cache.dtype == value_cache.dtype == torch.uint8
    assert key_cache.shape[2:] == (config.num_kv_heads, config.head_dim // 2 + 4)
    ours = prompt_logprobs(llm.generate(PROMPTS, PARAMS))
    assert bool(key_cache.any()) and bool(value_cache.any())  # the prompts went through the int4 cache
    diff = (ours - baseline).abs()
    ppl_ratio = math.exp(float(baseline.mean() - ours.mean()))
    assert diff.max() > 0  # the cache really rounds
    # measured: max 0.12, mean 0.042, ppl ratio 1.006 (int8 per-layer: 0.019 / 0.008 / 0.999)
    assert diff.max() < 0.3 and diff.mean() < 0.08, (diff.max(), diff.mean())
    assert 0.97 < ppl_ratio < 1.03


def test_int4_pages_in_a_shared_pool(llama_path):
    config = read_model_config(llama_path)
    spec = ModelKVSpec("m", config, torch.uint8, block_size=16, max_model_len=64, max_num_seqs=2)
    row = config.head_dim // 2 + 4
    assert spec.block_bytes == 2 * config.num_layers * 16 * config.num_kv_heads * row
    pool = SharedKVPool([spec], num_pages=5, device="cpu")
    assert pool.page_bytes == page_bytes_for([spec])
    caches = pool.kv_caches("m")
    assert len(caches) == config.num_layers
    for key, value in caches:
        assert key.dtype == torch.uint8 and key.shape == (5, 16, config.num_kv_heads, row)
        assert key.stride(0) == pool.page_bytes and value.stride(0) == pool.page_bytes
    # the layers' views tile the page without overlapping
    key0, value0 = caches[0]
    key0.fill_(1)
    assert int(value0.sum()) == 0
