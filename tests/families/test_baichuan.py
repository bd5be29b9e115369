"""Baichuan2 (``BaichuanForCausalLM``): W_pack, NormHead, RoPE (7B) and ALiBi (13B), against a
renamed Llama oracle (families.md section 8)."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.layers.attention import alibi_slopes
from qserve.model.registry import model_config
from tests.helpers.family_models import alibi_bias, alibi_logits, save_baichuan
from tests.helpers.tiny_models import make_tiny_model
from tests.integration.test_hf_parity import hf_greedy, hf_prompt_logprobs

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47))]


def _run(path, prompts, max_tokens=6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outputs = LLM(str(path), device="cpu", dtype="float32").generate([{"prompt_token_ids": p} for p in prompts], params)
    return [
        (
            torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(p) if i > 0]),
            o.outputs[0].token_ids,
        )
        for p, o in zip(prompts, outputs)
    ]


def _llama(num_heads: int, seed: int):
    return make_tiny_model(
        "LlamaForCausalLM",
        seed=seed,
        hidden_size=16 * num_heads,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        attn_implementation="eager",
    )


def test_variant_rule_and_overrides():
    base = {
        "architectures": ["BaichuanForCausalLM"],
        "hidden_size": 5120,
        "intermediate_size": 13696,
        "num_attention_heads": 40,
        "num_hidden_layers": 40,
        "vocab_size": 125696,
        "model_max_length": 4096,
    }
    cfg = model_config(base)
    assert cfg.alibi and cfg.lm_head_normalized  # 13B: ALiBi, NormHead (Baichuan2 vocabulary)
    cfg = model_config({**base, "hidden_size": 4096, "num_attention_heads": 32})
    assert not cfg.alibi and cfg.lm_head_normalized  # 7B: RoPE
    cfg = model_config({**base, "vocab_size": 64000})
    assert not cfg.lm_head_normalized  # Baichuan 1
    cfg = model_config({**base, "qserve_position_embedding": "rope", "qserve_norm_head": False})
    assert not cfg.alibi and not cfg.lm_head_normalized
    with pytest.raises(ValueError, match="qserve_position_embedding"):
        model_config({**base, "qserve_position_embedding": "xpos"})


@pytest.mark.parametrize("num_heads", [8, 5, 6, 40])
def test_alibi_slopes_match_baichuan(num_heads):
    expected = alibi_bias(num_heads, 2)[0, :, 1, 1]  # slope * 1
    assert torch.allclose(alibi_slopes(num_heads), expected)


@pytest.mark.slow
def test_rope_variant_with_norm_head(tmp_path):
    model = _llama(4, seed=4)
    path = save_baichuan(model, tmp_path / "baichuan-7b", "rope")
    for prompt, (lps, tokens) in zip(PROMPTS, _run(path, PROMPTS)):
        theirs = hf_prompt_logprobs(model, prompt)
        assert torch.allclose(lps, theirs, atol=1e-4, rtol=0), (lps - theirs).abs().max()
        assert tokens == hf_greedy(model, prompt, 6)


@pytest.mark.parametrize("num_heads", [4, 5])  # 5: the non-power-of-two slope branch
@pytest.mark.slow
def test_alibi_variant_matches_oracle(tmp_path, num_heads):
    model = _llama(num_heads, seed=5)
    path = save_baichuan(model, tmp_path / "baichuan-13b", "alibi")
    for prompt, (lps, tokens) in zip(PROMPTS, _run(path, PROMPTS)):
        logprobs = torch.log_softmax(alibi_logits(model, prompt), dim=-1)
        theirs = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(lps, theirs, atol=1e-4, rtol=0), (lps - theirs).abs().max()
        ids = list(prompt)
        for _ in range(6):
            ids.append(int(alibi_logits(model, ids)[-1].argmax()))
        assert tokens == ids[len(prompt) :]
    # Not a tautology: without ALiBi (plain causal Llama with RoPE) the logprobs differ.
    plain = hf_prompt_logprobs(model, PROMPTS[1])
    assert (_run(path, PROMPTS[1:])[0][0] - plain).abs().max() > 1e-3
