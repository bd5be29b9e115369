"""qserve's LoRA equals PEFT's own forward (the oracle): a dense fp16 base with two adapters made by
``peft.get_peft_model`` (all seven projections with rsLoRA; q/v only with plain alpha / r scaling),
their matrices drawn at random and saved by ``save_pretrained``, served in one batch with the base."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, LoRARequest, SamplingParams
from tests.helpers.tiny_models import make_tiny_model, save_tiny_checkpoint

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [5, 17, 93, 2, 211, 64, 8, 150, 33, 71, 12, 99]


def _peft_adapter(base, path, seed: int, **config) -> object:
    """A PEFT model over a copy of ``base`` with random A and B (PEFT starts B at zero), saved to ``path``."""
    model = make_tiny_model("LlamaForCausalLM").half()
    model.load_state_dict(base.state_dict())
    peft_model = peft.get_peft_model(model, peft.LoraConfig(lora_dropout=0.0, **config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(path)
    return peft_model.eval()


def _logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]  # [T - 1]


def test_lora_matches_peft_forward(tmp_path) -> None:
    base = make_tiny_model("LlamaForCausalLM").half().eval()
    path = save_tiny_checkpoint(base, tmp_path / "base", dtype=torch.float16)
    peft_all = _peft_adapter(base, tmp_path / "all", 1, r=8, lora_alpha=16, target_modules=ALL, use_rslora=True)
    peft_qv = _peft_adapter(base, tmp_path / "qv", 2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    llm = LLM(
        str(path), device="cpu", dtype="float16", enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=16
    )
    loras = [LoRARequest("all", 1, str(tmp_path / "all")), LoRARequest("qv", 2, str(tmp_path / "qv")), None]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False, lora_request=loras)
    got = [torch.tensor([next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]]) for o in outputs]
    want = [_logprobs(peft_all, PROMPT), _logprobs(peft_qv, PROMPT), _logprobs(base, PROMPT)]
    for name, g, w in zip(("all", "qv", "base"), got, want):
        torch.testing.assert_close(g, w, atol=1e-2, rtol=0, msg=name)
    # The control: the adapters move the logprobs far more than the tolerance.
    assert (want[0] - want[2]).abs().max() > 0.3 and (want[1] - want[2]).abs().max() > 0.3


def test_lora_on_glm_matches_peft(tmp_path) -> None:
    """GLM (float32): q/k rows reordered at load for its interleaved rotary (the adapters' B rows follow),
    and PEFT's adapter of the fused ``gate_up_proj`` module (one A shared by both slices, B split)."""
    from tests.helpers.family_models import glm_oracle, save_native

    base = glm_oracle("GlmForCausalLM", seed=4)
    path = save_native(base, tmp_path / "glm")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]
    adapted = glm_oracle("GlmForCausalLM", seed=4)
    peft_model = peft.get_peft_model(
        adapted, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(tmp_path / "adapter")
    llm = LLM(str(path), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=4, num_kv_blocks=16)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    loras = [LoRARequest("glm", 1, str(tmp_path / "adapter")), None]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, params, use_tqdm=False, lora_request=loras)
    for output, oracle in zip(outputs, (peft_model.eval(), base)):
        got = torch.tensor([next(iter(p.values())).logprob for p in output.prompt_logprobs[1:]])
        torch.testing.assert_close(got, _logprobs(oracle, PROMPT), atol=2e-4, rtol=0)
    assert (_logprobs(peft_model, PROMPT) - _logprobs(base, PROMPT)).abs().max() > 0.1
