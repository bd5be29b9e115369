"""``qserve quantize`` of mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): GPTQ per expert
from the tokens the router sends it, the round-to-nearest fallback for experts that see too few, and
the result (GPTQ, RTN or AWQ: tests/quantize/test_moe_awq.py has AWQ's own tests) served by ``LLM``."""

from __future__ import annotations

import json

import pytest
import torch

from qserve import LLM, SamplingParams
from qserve.layers.moe import SparseMoeBlock
from qserve.model.registry import model_config
from quant_kernels.moe_layout import StackedQuantWeight
from tests.helpers.moe_models import moe_oracle, save_moe
from tests.quantize.conftest import run_command


@pytest.mark.parametrize(
    ("arch", "method", "extra"),
    [
        ("Qwen3MoeForCausalLM", "gptq", []),
        ("Qwen2MoeForCausalLM", "gptq", ["--desc-act"]),
        ("Qwen3MoeForCausalLM", "rtn", []),
        ("MixtralForCausalLM", "gptq", []),
        ("MixtralForCausalLM", "awq", []),
        ("Qwen2MoeForCausalLM", "awq", []),
    ],
)
def test_quantize_moe_then_generate(tmp_path, calib_file, capsys, arch, method, extra) -> None:
    src = save_moe(moe_oracle(arch, seed=21), tmp_path / "src")
    dst = tmp_path / method
    argv = [str(src), str(dst), "--method", method, "--group-size", "32", "--device", "cpu", *extra]
    if method != "rtn":
        argv += ["--calib", str(calib_file), "--num-samples", "4", "--seq-len", "64"]
    assert run_command("quantize", argv) == 0
    assert "wrote" in capsys.readouterr().out
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == ("awq" if method == "awq" else "gptq")
    assert config["architectures"] == [arch]

    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0)
    llm = LLM(str(dst), device="cpu", dtype="float32")
    quantized = llm.generate(["Hello world, the"], params)[0]
    reference = LLM(str(src), device="cpu", dtype="float32").generate(["Hello world, the"], params)[0]
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.w_gate_up, StackedQuantWeight) for b in blocks)
    assert all((b.w_gate_up.zeros is not None) == (method == "awq") for b in blocks)  # gptq/rtn: symmetric
    assert all(float(b.gate.weight.abs().sum()) > 0 for b in blocks)  # the router was kept (16-bit)
    ids = quantized.prompt_token_ids
    lp_q = torch.tensor([quantized.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    lp_r = torch.tensor([reference.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
    assert float((lp_q - lp_r).abs().mean()) < 0.5


def test_starved_experts_fall_back_to_rtn() -> None:
    from qserve.layers.rotary import RotaryEmbedding
    from qserve.quantize.gptq import GPTQSettings
    from qserve.quantize.moe import MoEQuantReport, SparseDecoderLayer, quantize_layer_gptq_moe
    from qserve.quantize.rtn import RTNSettings, quantize_weight_rtn
    from tests.helpers.moe_models import checkpoint_tensors

    model = moe_oracle("Qwen3MoeForCausalLM", seed=22, mlp_only_layers=[])
    config = model_config(model.config.to_dict())
    tensors = {
        k[len("model.layers.0.") :]: v for k, v in checkpoint_tensors(model).items() if k.startswith("model.layers.0.")
    }
    with torch.no_grad():  # positive inputs, no attention output: the router sends every token to experts 0 and 1
        tensors["self_attn.o_proj.weight"].zero_()
        tensors["mlp.gate.weight"][:2] = 1.0
        tensors["mlp.gate.weight"][2:] = -1.0
    rotary = RotaryEmbedding(config.rope, config.head_dim, 16)
    hidden = torch.rand(4, 16, config.hidden_size) + 0.1  # [S, T, H]
    settings = GPTQSettings(4, 32, True, False, 0.01, 128)
    layer = SparseDecoderLayer(config, dict(tensors), rotary, "cpu")
    originals = {n: layer.linear(n).weight.clone() for n in layer.linear_names}
    report = MoEQuantReport()
    results = quantize_layer_gptq_moe(layer, hidden, settings, 2, report)
    starved = {f"mlp.experts.{e}.{p}" for e in range(2, 8) for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(report.rtn_fallback) == starved and report.experts == 8
    rtn = quantize_weight_rtn(originals["experts__5__up_proj"], RTNSettings(4, 32, True))
    assert torch.equal(results["experts__5__up_proj"].weight(), rtn.weight())
    assert not torch.equal(
        results["experts__0__up_proj"].weight(),
        quantize_weight_rtn(originals["experts__0__up_proj"], RTNSettings(4, 32, True)).weight(),
    )  # a fed expert gets GPTQ's error feedback
