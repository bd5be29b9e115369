"""ChatGLM2/3 (remote-code ``chatglm`` format) and native GLM / GLM-4-0414 against transformers'
GlmForCausalLM / Glm4ForCausalLM (families.md section 8: ChatGLM is a renamed Glm)."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.model.registry import model_config, read_model_config
from tests.helpers.family_models import glm_oracle, save_chatglm, save_native
from tests.integration.test_hf_parity import hf_greedy, hf_prompt_logprobs

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47))]


def _check(model, path):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(str(path), device="cpu", dtype="float32")
    for prompt, output in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)):
        ours = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
        theirs = hf_prompt_logprobs(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 6)


def test_chatglm_matches_glm_oracle(tmp_path):
    model = glm_oracle(seed=6, rope_theta=10000.0 * 4)
    path = save_chatglm(model, tmp_path / "chatglm3", rope_ratio=4)
    cfg = read_model_config(path)
    assert (cfg.architecture, cfg.num_kv_heads, cfg.rotary_dim, cfg.rope_interleaved) == ("ChatGLMModel", 2, 8, True)
    assert cfg.rope.theta == 40000.0
    _check(model, path)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["GlmForCausalLM", "Glm4ForCausalLM"])
def test_native_glm_matches_transformers(tmp_path, arch):
    model = glm_oracle(arch, seed=7)
    path = save_native(model, tmp_path / arch)
    assert read_model_config(path).sandwich_norms == (arch == "Glm4ForCausalLM")
    _check(model, path)


def test_chatglm_unsupported_variant_is_refused():
    cfg = {
        "architectures": ["ChatGLMModel"],
        "num_layers": 1,
        "hidden_size": 64,
        "ffn_hidden_size": 96,
        "kv_channels": 16,
        "num_attention_heads": 4,
        "padded_vocab_size": 100,
        "add_bias_linear": True,
    }
    with pytest.raises(ValueError, match="add_bias_linear"):
        model_config(cfg)


def test_chatglm3_served_with_its_sentencepiece_tokenizer(tmp_path):
    """As released: tokenizer.model only (no tokenizer.json). Text prompts get ChatGLM's
    [gMASK]sop prefix and streamed text equals SentencePiece's decoding of the tokens."""
    import json

    import sentencepiece as spm

    from tests.helpers.family_tokenizers import train_sentencepiece

    path = save_chatglm(glm_oracle(seed=3), tmp_path / "chatglm3", rope_ratio=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    (path / "tokenizer.model").write_bytes(train_sentencepiece(330))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "_name_or_path": "THUDM/chatglm3-6b"}))
    sp = spm.SentencePieceProcessor(model_file=str(path / "tokenizer.model"))
    llm = LLM(str(path), device="cpu", dtype="float32")
    out = llm.generate(["Hello world"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert out.prompt_token_ids == [330 + 1, 330 + 3] + sp.encode("Hello world")
    generated = [t for t in out.outputs[0].token_ids if t < 330]
    assert generated == out.outputs[0].token_ids  # the tiny model stays inside the SentencePiece vocabulary
    text = out.outputs[0].text  # the detokenizer holds back a trailing incomplete UTF-8 character
    assert text and sp.decode(generated).startswith(text) and "<0x" not in text


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_quantized_glm_rows_permuted_at_load(tmp_path, fmt):
    """Interleaved rotary costs no per-step gather: the q/k projection rows are put in NeoX
    order once at load (dense, and the canonical quantized columns incl. asymmetric zeros and
    GPTQ act-order); outputs still match the oracle holding the dequantized weights."""
    from tests.helpers.quant_packers import awq_config, gptq_config, quantize_state_dict, write_checkpoint
    from tests.helpers.tokenizer import make_tokenizer

    model = glm_oracle(seed=8)
    split = {}  # the fused gate_up_proj as gate_proj / up_proj, so that every linear is quantized
    for name, value in model.state_dict().items():
        if name.endswith("mlp.gate_up_proj.weight"):
            gate, up = value.chunk(2)
            split[name.replace("gate_up_proj", "gate_proj")], split[name.replace("gate_up_proj", "up_proj")] = gate, up
        else:
            split[name] = value
    quantized = quantize_state_dict(split, fmt, group_size=32, sym=False, act_order=fmt == "gptq")
    assert any(k.endswith("self_attn.q_proj.qweight") for k in quantized.tensors)
    with torch.no_grad():
        state = model.state_dict()
        for module, weight in quantized.dequant.items():
            if module.endswith("mlp.gate_proj"):
                up = quantized.dequant[module.replace("gate_proj", "up_proj")]
                state[module.replace("gate_proj", "gate_up_proj.weight")].copy_(torch.cat([weight, up]))
            elif not module.endswith("mlp.up_proj"):
                state[f"{module}.weight"].copy_(weight)
    config = model.config.to_dict()
    config["quantization_config"] = (
        gptq_config(group_size=32, sym=False, desc_act=True) if fmt == "gptq" else awq_config(group_size=32)
    )
    path = write_checkpoint(tmp_path / f"glm-{fmt}", config, quantized.tensors)
    make_tokenizer(str(path))
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.engine.model.rotary.perm is None  # nothing to gather per step
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    for prompt, output in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)):
        ours = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
        theirs = hf_prompt_logprobs(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 6)
