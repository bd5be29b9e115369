"""A model whose vocabulary is padded past its tokenizer's (Qwen: 151936 rows, 151851 tokens):
the padded ids are never sampled and never appear in logprobs, top logprobs or prompt logprobs.

The tiny Llama has 2 * hidden padded rows, +-BIG * e_j: whatever the final hidden state, one
of them scores BIG * max|h_j| >= BIG (the RMS-normalized state has some |h_j| >= 1), far above
every real token, so without the mask greedy decoding would pick a padded id at every step."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.runner.sampler import Sampler, build_sampling_metadata, compute_prompt_logprobs, mask_padded_vocab
from qserve.tokenization import num_token_ids
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint
from tests.helpers.tokenizer import make_tokenizer

BIG = 30.0
PROMPTS = [[5, 17, 42, 99, 3, 250], list(range(10, 30))]


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    num_tokens = num_token_ids(make_tokenizer())
    hidden = 64
    model = make_tiny_model("LlamaForCausalLM", seed=7, vocab_size=num_tokens + 2 * hidden, hidden_size=hidden)
    with torch.no_grad():
        eye = torch.eye(hidden)
        model.lm_head.weight[num_tokens:] = BIG * torch.cat([eye, -eye])
    path = save_tiny_checkpoint(model, tmp_path_factory.mktemp("padded-vocab"))
    return model, str(path), num_tokens


def _oracle_logprobs(model, token_ids: list[int], num_tokens: int) -> torch.Tensor:
    """[L, num_tokens]: transformers' log-softmax over the real tokens only."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()  # [L, V]
    return torch.log_softmax(logits[:, :num_tokens], dim=-1)


def test_unmasked_model_prefers_padded_ids(padded):
    """The test's premise: without a mask the padded rows win at every position."""
    model, _, num_tokens = padded
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[1]])).logits[0]  # [L, V]
    assert (logits.argmax(-1) >= num_tokens).all()


def test_padded_ids_never_sampled_or_reported(padded):
    model, path, num_tokens = padded
    llm = LLM(path, device="cpu", dtype="float32")
    assert llm.engine.runner.valid_vocab_size == num_tokens < model.config.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    for prompt, out in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)):
        tokens = out.outputs[0].token_ids
        oracle = _oracle_logprobs(model, prompt + tokens, num_tokens)  # [L, num_tokens]
        assert tokens == oracle[len(prompt) - 1 : -1].argmax(-1).tolist()  # greedy over real tokens
        for i, (entry, token) in enumerate(zip(out.outputs[0].logprobs, tokens)):
            assert max(entry) < num_tokens
            assert abs(entry[token].logprob - oracle[len(prompt) - 1 + i, token].item()) < 1e-4
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            assert max(entry) < num_tokens
            assert abs(entry[prompt[i + 1]].logprob - oracle[i, prompt[i + 1]].item()) < 1e-4
    sampled = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=3, logprobs=20)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 4, sampled)
    for o in out:
        assert max(o.outputs[0].token_ids) < num_tokens
        assert all(max(entry) < num_tokens for entry in o.outputs[0].logprobs)


def test_sampler_masks_without_touching_the_callers_logits():
    logits = torch.randn(3, 10)
    logits[:, 7:] = 1e4  # [R, V]: columns 7..9 are padding
    before = logits.clone()
    md = build_sampling_metadata([SamplingParams(temperature=0, logprobs=9)] * 3, [[1]] * 3, [[]] * 3, [], 10, "cpu")
    tokens, logprobs = Sampler(valid_vocab_size=7)(logits, md)
    assert torch.equal(logits, before)
    assert tokens == before[:, :7].argmax(-1).tolist()
    assert all(max(lp.token_ids) < 7 for lp in logprobs)
    assert Sampler()(logits, md)[0] != tokens  # unmasked, the padding wins
    entries = compute_prompt_logprobs(logits, torch.tensor([0, 1, 2]), 3, valid_vocab_size=7)
    assert all(max(e.token_ids) < 7 for e in entries)
    assert mask_padded_vocab(logits, 10) is logits and mask_padded_vocab(logits, None) is logits
