"""qserve's prompt logprobs and greedy tokens equal transformers' on tiny random models."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from tests.helpers.tiny_models import ARCHITECTURES

PROMPTS = [
    [5, 17, 42, 99, 3],
    list(range(10, 47)),  # spans several KV blocks
    [7] * 3 + [250, 251, 252, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]


def hf_prompt_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()  # [L, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(token_ids) - 1), torch.tensor(token_ids[1:])]  # [L - 1]


def hf_greedy(model, token_ids: list[int], num_tokens: int) -> list[int]:
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids) :]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prompt_logprobs_and_greedy_match_transformers(tiny_checkpoints, arch):
    hf_model, path = tiny_checkpoints[arch]
    llm = LLM(path, device="cpu", dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_logprobs[0] is None
        ours = torch.tensor([output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i > 0])
        theirs = hf_prompt_logprobs(hf_model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)
        assert output.outputs[0].finish_reason == "length"


def test_sliding_window_matches_transformers(tmp_path):
    from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

    hf_model = make_tiny_model("MistralForCausalLM", seed=7, sliding_window=8)
    path = save_tiny_checkpoint(hf_model, tmp_path / "mistral-sw")
    prompt = list(range(20, 50))
    output = LLM(str(path), device="cpu", dtype="float32").generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    )[0]
    ours = torch.tensor([output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i > 0])
    assert torch.allclose(ours, hf_prompt_logprobs(hf_model, prompt), atol=1e-4, rtol=0)
    assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 6)
