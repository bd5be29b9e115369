"""fp8 and int8 KV caches: scales set at start-up, outputs close to the model-dtype cache."""

from __future__ import annotations

import math

import pytest
import torch

from qserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(5, 60))}, {"prompt_token_ids": [9, 8, 7] * 20}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)


def prompt_logprobs(outputs) -> torch.Tensor:
    values = []
    for output in outputs:
        ids = output.prompt_token_ids
        values += [output.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    return torch.tensor(values)


@pytest.fixture(scope="module")
def baseline(tiny_checkpoints):
    path = tiny_checkpoints["LlamaForCausalLM"][1]
    return prompt_logprobs(LLM(path, device="cpu", dtype="float32").generate(PROMPTS, PARAMS))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_kv_cache_stays_close(tiny_checkpoints, baseline, kv_cache_dtype):
    path = tiny_checkpoints["LlamaForCausalLM"][1]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype)
    cache = llm.engine.runner.kv_caches[0][0]
    assert cache.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    attn = llm.engine.model.model.layers[0].self_attn.attn
    if kv_cache_dtype == "int8":
        assert float(attn.k_scale) != 1.0  # calibrated from the profiling pass
    ours = prompt_logprobs(llm.generate(PROMPTS, PARAMS))
    diff = (ours - baseline).abs()
    # Perplexity change, as the GPU benchmark reports it.
    ppl_ratio = math.exp(float(baseline.mean() - ours.mean()))
    assert diff.max() < 0.25 and diff.mean() < 0.05, (diff.max(), diff.mean())
    assert 0.97 < ppl_ratio < 1.03


def test_unknown_kv_cache_dtype_is_named(tiny_checkpoints):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'.*supported: auto, fp8, int8"):
        LLM(tiny_checkpoints["LlamaForCausalLM"][1], device="cpu", kv_cache_dtype="fp4")
