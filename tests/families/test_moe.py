"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral) against their native transformers
models: prompt logprobs and greedy tokens on CPU, unquantized and from GPTQ / AWQ /
compressed-tensors W4A16 checkpoints whose experts load into one stacked tensor per layer."""

from __future__ import annotations

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.layers.moe import SparseMoeBlock
from qserve.model.registry import model_config, read_model_config
from quant_kernels.moe_layout import StackedQuantWeight
from tests.helpers.moe_models import moe_oracle, save_moe
from tests.integration.test_hf_parity import hf_greedy, hf_prompt_logprobs

PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 47))]


def _check(model, path) -> LLM:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(str(path), device="cpu", dtype="float32")
    for prompt, output in zip(PROMPTS, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)):
        ours = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
        theirs = hf_prompt_logprobs(model, prompt)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=0), (ours - theirs).abs().max()
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 6)
    return llm


def _blocks(llm: LLM) -> list[SparseMoeBlock]:
    return [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"])
def test_moe_family_matches_transformers(tmp_path, arch):
    model = moe_oracle(arch, seed=11)
    path = save_moe(model, tmp_path / arch)
    config = read_model_config(path)
    expected_layers = (1,) if arch == "Qwen3MoeForCausalLM" else (0, 1)  # Qwen3's mlp_only_layers=[0]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_layers) == (8, 2, expected_layers)
    llm = _check(model, path)
    blocks = _blocks(llm)
    assert len(blocks) == len(expected_layers)
    assert blocks[0].w_gate_up.shape == (8, 64, 64) and blocks[0].w_down.shape == (8, 64, 32)
    assert (blocks[0].shared_expert is not None) == (arch == "Qwen2MoeForCausalLM")


@pytest.mark.parametrize(
    ("arch", "fmt", "sym", "act_order"),
    [
        ("Qwen3MoeForCausalLM", "gptq", True, False),
        ("Qwen2MoeForCausalLM", "gptq", False, True),
        ("MixtralForCausalLM", "awq", False, False),
        ("Qwen3MoeForCausalLM", "ct", False, False),
    ],
)
def test_quantized_moe_checkpoint(tmp_path, arch, fmt, sym, act_order):
    """GPTQModel-style per-expert W4A16 tensors (router 16-bit) load into one stacked packed-int4
    tensor per layer (GPTQ act-order: one permutation per expert); outputs match the oracle
    holding the dequantized weights."""
    model = moe_oracle(arch, seed=12)
    path = save_moe(model, tmp_path / f"{arch}-{fmt}", fmt=fmt, group_size=32, sym=sym, act_order=act_order)
    llm = _check(model, path)
    for block in _blocks(llm):
        gate_up, down = block.w_gate_up, block.w_down
        assert isinstance(gate_up, StackedQuantWeight) and isinstance(down, StackedQuantWeight)
        assert gate_up.qweight.shape == (8, 64 // 8, 2 * 32) and down.qweight.shape == (8, 32 // 8, 64)
        assert (gate_up.zeros is None) == sym
        assert (gate_up.perm is not None) == act_order  # down (K = 32 = one group) needs none
        assert block.gate.weight.dtype == torch.float32  # the router stays unquantized


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_quantized_moe_on_gpu_matches_cpu(tmp_path, monkeypatch, fused):
    """The GPU paths (default: per-expert W4A16 kernels, eager; QSERVE_FUSED_MOE=1: the fused
    kernel under CUDA graphs) give the CPU reference's greedy tokens."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("QSERVE_FUSED_MOE", "1" if fused else "0")
    model = moe_oracle("Qwen3MoeForCausalLM", seed=13, hidden_size=256, moe_intermediate_size=128)
    path = save_moe(model, tmp_path / "qwen3moe-gptq", fmt="gptq", group_size=64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    cpu = LLM(str(path), device="cpu", dtype="float32").generate(prompts, params)
    # a KV pool sized to the whole card (31 GiB) ran out of memory beside the other test workers
    gpu_llm = LLM(str(path), device="cuda", dtype="float16", num_kv_blocks=64)
    assert gpu_llm.engine.model.supports_cuda_graphs == fused
    gpu = gpu_llm.generate(prompts, params)
    agree = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(cpu, gpu))
    assert agree == len(PROMPTS)


@pytest.mark.slow
def test_experts_stream_into_one_stacked_tensor(tmp_path):
    """Loading holds one checkpoint tensor / about one expert's tensors beyond the stacked
    per-layer storage: no copy of a whole layer's (let alone the model's) experts is ever made."""
    import loaders
    from qserve.layers.quant_methods import make_linear_method
    from qserve.model.llama import LlamaFamilyForCausalLM
    from qserve.model.registry import checkpoint_view
    from tests.helpers.live_bytes import LiveBytes

    num_experts = 48
    model = moe_oracle("Qwen3MoeForCausalLM", seed=3, num_experts=num_experts, moe_intermediate_size=64)
    path = save_moe(model, tmp_path / "qwen3moe-gptq", fmt="gptq", group_size=32)
    config = read_model_config(path)
    spec = loaders.detect(path)
    ours = LlamaFamilyForCausalLM(config, torch.float32, lambda names: make_linear_method(spec, names))
    with LiveBytes() as live:
        ours.load_weights(loaders.iter_weights(path, spec, checkpoint_view(config.raw)))
    (block,) = [m for m in ours.modules() if isinstance(m, SparseMoeBlock)]
    stacked = block.w_gate_up.nbytes() + block.w_down.nbytes()
    assert live.current >= stacked  # the stacked storage is what stays
    largest = 2 * model.lm_head.weight.numel() * 4  # one dense tensor read (and its finiteness check) at a time
    assert live.peak - live.current <= largest + 4 * stacked // num_experts, (live.peak, live.current, stacked)


def test_moe_refusals_name_the_field():
    from qserve.model.llama import _moe_block

    model = moe_oracle("MixtralForCausalLM", seed=1)
    bad = {**model.config.to_dict(), "num_experts_per_tok": 9}
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        model_config(bad)
    config = model_config(model.config.to_dict())
    assert config.moe_expert_names == ("w1", "w3", "w2") and config.norm_topk_prob
    from qserve.distributed.parallel_state import TPGroup

    three = TPGroup(rank=0, size=3, backend="gloo", device=torch.device("cpu"))  # 8 experts do not split in 3
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by tensor_parallel_size=3"):
        _moe_block(config, "model.layers.0.mlp", torch.float32, lambda names: None, three, enable_expert_parallel=True)
