"""Qwen v1 (``QWenLMHeadModel``) against its oracle: a renamed Qwen2 (families.md section 8)."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.model.registry import model_config
from tests.helpers.family_models import (
    qwen2_oracle,
    qwen_long_oracle,
    qwen_v1_config,
    save_qwen_v1,
    save_qwen_v1_gptq,
)
from tests.integration.test_hf_parity import hf_greedy, hf_prompt_logprobs

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47))]


def _ours(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    result = []
    for prompt, output in zip(prompts, outputs):
        lps = torch.tensor([output.prompt_logprobs[i][tok].logprob for i, tok in enumerate(prompt) if i > 0])
        result.append((lps, output.outputs[0].token_ids))
    return result


def test_config_translation():
    model = qwen2_oracle()
    cfg = model_config(qwen_v1_config(model, seq_length=16))
    assert cfg.architecture == "QWenLMHeadModel" and cfg.family == "qwen"
    assert cfg.intermediate_size == model.config.intermediate_size  # halved
    assert cfg.num_kv_heads == cfg.num_heads == 4
    assert cfg.qkv_bias and not cfg.o_bias
    assert cfg.dynamic_ntk and cfg.logn_attn and cfg.seq_length == 16


def test_aliases_and_default_stop_ids():
    cfg = qwen_v1_config(qwen2_oracle(), seq_length=16)
    for new, old in (("hidden_size", "n_embd"), ("num_attention_heads", "n_head"), ("num_hidden_layers", "n_layer")):
        cfg[old] = cfg.pop(new)
    cfg["ffn_hidden_size"] = cfg.pop("intermediate_size")
    cfg["vocab_size"] = 151936
    del cfg["eos_token_id"]
    parsed = model_config(cfg)
    assert parsed.hidden_size == 64 and parsed.num_layers == 2
    assert parsed.eos_token_ids == (151643, 151645, 151644)  # <|endoftext|>, <|im_end|>, <|im_start|>


def test_matches_oracle_within_seq_length(tmp_path):
    model = qwen2_oracle(seed=1)
    path = save_qwen_v1(model, tmp_path / "qwen", seq_length=64)
    llm = LLM(str(path), device="cpu", dtype="float32")
    for prompt, (lps, tokens) in zip(PROMPTS, _ours(llm, PROMPTS)):
        theirs = hf_prompt_logprobs(model, prompt)
        assert torch.allclose(lps, theirs, atol=1e-4, rtol=0), (lps - theirs).abs().max()
        assert tokens == hf_greedy(model, prompt, 6)


@pytest.mark.slow
def test_dynamic_ntk_and_logn_beyond_seq_length(tmp_path):
    """seq_length 16: prompts of 12 (alpha 1), 20 (alpha 3) and 40 tokens (alpha 7) in one batch;
    generation crosses seq_length for the first, and logn scales every query past position 15."""
    seq_length = 16
    model = qwen2_oracle(seed=2)
    path = save_qwen_v1(model, tmp_path / "qwen-long", seq_length=seq_length)
    llm = LLM(str(path), device="cpu", dtype="float32", enable_prefix_caching=False)
    prompts = [list(range(30, 42)), list(range(50, 70)), [(7 * i) % 300 + 3 for i in range(40)]]
    ours = _ours(llm, prompts, max_tokens=8)
    for prompt, (lps, tokens) in zip(prompts, ours):
        oracle = qwen_long_oracle(model, len(prompt), seq_length)
        theirs = hf_prompt_logprobs(oracle, prompt)
        assert torch.allclose(lps, theirs, atol=1e-4, rtol=0), (len(prompt), (lps - theirs).abs().max())
        assert tokens == hf_greedy(oracle, prompt, 8)
    # Not a tautology: plain Qwen2 (no NTK, no logn) disagrees beyond seq_length.
    plain = hf_prompt_logprobs(model, prompts[2])
    assert (ours[2][0] - plain).abs().max() > 1e-3


@pytest.mark.parametrize("prompt_len,expected", [(1, 0), (16, 0), (17, 1), (32, 1), (33, 2), (64, 2), (65, 3)])
def test_ntk_alpha_index(prompt_len, expected):
    from qserve.layers.rotary import ntk_alpha_index

    assert ntk_alpha_index(prompt_len, 16) == expected


def test_gptq_int4_release_layout(tmp_path):
    """Fused c_attn quantized whole (split by the loader), zero biases on the other quantized
    layers skipped, w2/w1 as gate/up; the oracle holds the dequantized weights."""
    model = qwen2_oracle(seed=3)
    path = save_qwen_v1_gptq(model, tmp_path / "qwen-int4")
    llm = LLM(str(path), device="cpu", dtype="float32")
    for prompt, (lps, tokens) in zip(PROMPTS, _ours(llm, PROMPTS)):
        theirs = hf_prompt_logprobs(model, prompt)
        assert torch.allclose(lps, theirs, atol=1e-4, rtol=0), (lps - theirs).abs().max()
        assert tokens == hf_greedy(model, prompt, 6)


def test_gptq_nonzero_bias_on_unbiased_layer_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_qwen_v1_gptq(qwen2_oracle(seed=3), tmp_path / "qwen-int4-bad")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["transformer.h.0.mlp.w1.bias"] = torch.ones_like(tensors["transformer.h.0.mlp.w1.bias"])
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="non-zero bias"):
        LLM(str(path), device="cpu", dtype="float32")


@pytest.mark.slow
def test_served_with_its_tiktoken_tokenizer(tmp_path):
    """A Qwen v1 directory as released: qwen.tiktoken and a remote-code tokenizer_config, no
    tokenizer.json. The engine loads the tokenizer without remote code and stops on ChatML ends."""
    import json

    from qserve.tokenization import qwen as qwen_tok
    from tests.helpers.family_models import qwen_v1_tensors
    from tests.helpers.family_tokenizers import TEXT, bpe_ranks, write_tiktoken

    root = tmp_path / "qwen-chat"
    root.mkdir()
    write_tiktoken(root / "qwen.tiktoken", bpe_ranks(TEXT, qwen_tok.PAT_STR, 40))
    num_ranks = 256 + 40
    model = qwen2_oracle(seed=9, vocab_size=num_ranks + len(qwen_tok.SPECIAL_TOKENS) + 10)  # padded like Qwen's
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in qwen_v1_tensors(model).items()}, str(root / "model.safetensors"))
    config = qwen_v1_config(model, seq_length=64)
    del config["eos_token_id"]  # as released: none in config.json
    (root / "config.json").write_text(json.dumps(config))
    (root / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "QWenTokenizer"}))
    llm = LLM(str(root), device="cpu", dtype="float32")
    tok = llm.get_tokenizer()
    assert {num_ranks, num_ranks + 1, num_ranks + 2} <= llm.engine.eos_token_ids  # endoftext, im_start, im_end
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hello world"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok.encode(text, add_special_tokens=False)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=0))[
        0
    ]
    lps = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
    # The 10 padded rows hold no token: the oracle's distribution is over the tokenizer's ids.
    num_tokens = num_ranks + len(qwen_tok.SPECIAL_TOKENS)
    assert llm.engine.runner.valid_vocab_size == num_tokens
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :, :num_tokens].float()  # [L, num_tokens]
    theirs = torch.log_softmax(logits, dim=-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(lps, theirs, atol=1e-4, rtol=0)


def test_ntk_alpha_indices_match_the_scalar_rule():
    import numpy as np

    from qserve.runner.ntk_index import ntk_alpha_index, ntk_alpha_indices

    lens = np.array([1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4096, 4097, 10**6])
    for seq_length in (1, 16, 2048):
        expected = [ntk_alpha_index(int(n), seq_length) for n in lens]
        assert ntk_alpha_indices(lens, seq_length).tolist() == expected


def test_mixed_ntk_decode_replays_the_graph_and_matches_oracle(tmp_path):
    """Decode batches mixing alpha 1 (12-token prompt) with alpha 3 (20) and alpha 7 (40) go
    through the CUDA-graph path (graphs stood in by eager replays of the same static-buffer
    forward, as in tests/integration/test_decode_graph_inputs.py): each row's rotary table is a
    graph input. Every generated token and its logprob match the transformers oracle."""
    from tests.integration.test_decode_graph_inputs import install_fake_graphs

    seq_length = 16
    model = qwen2_oracle(seed=2)
    path = save_qwen_v1(model, tmp_path / "qwen-long", seq_length=seq_length)
    llm = LLM(str(path), device="cpu", dtype="float32", enable_prefix_caching=False, max_num_seqs=4)
    graphs = install_fake_graphs(llm, buckets=(1, 2, 4))
    assert graphs.ntk_tables is not None  # the model holds several NTK tables: a static input
    replayed = []
    original = graphs.replay

    def replay(input_ids, positions, slots, block_tables, ntk_tables=None, **kwargs):
        replayed.append(None if ntk_tables is None else ntk_tables.tolist())
        return original(input_ids, positions, slots, block_tables, ntk_tables, **kwargs)

    graphs.replay = replay
    prompts = [list(range(30, 42)), list(range(50, 70)), [(7 * i) % 300 + 3 for i in range(40)]]
    max_tokens = 5
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [0, 1, 2] in replayed, replayed  # one decode batch: alpha 1, 3 and 7 together
    for prompt, output in zip(prompts, outputs):
        tokens = output.outputs[0].token_ids
        ours = torch.tensor([entry[tok].logprob for entry, tok in zip(output.outputs[0].logprobs, tokens)])
        oracle = qwen_long_oracle(model, len(prompt), seq_length)
        assert tokens == hf_greedy(oracle, prompt, max_tokens)
        theirs = hf_prompt_logprobs(oracle, prompt + tokens)[-max_tokens:]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (len(prompt), (ours - theirs).abs().max())


def test_decode_graph_decision_does_not_depend_on_rotary_tables():
    """The runner's eager-vs-graph rule: pure decode (every sequence one new sampled token, no
    prompt logprobs) within the captured buckets. Rotary tables are no part of it."""
    from qserve.runner.model_runner import uses_decode_graph

    class Graphs:
        @staticmethod
        def bucket_for(batch: int) -> int | None:
            return 4 if batch <= 4 else None

    assert uses_decode_graph(Graphs, True, 3, 3, False)
    assert not uses_decode_graph(Graphs, False, 3, 3, False)  # some sequence has several new tokens
    assert not uses_decode_graph(Graphs, True, 2, 3, False)  # a sequence samples nothing this step
    assert not uses_decode_graph(Graphs, True, 3, 3, True)  # prompt logprobs need hidden states
    assert not uses_decode_graph(Graphs, True, 5, 5, False)  # larger than every captured bucket
