"""``qserve quantize --method awq`` of mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral): AutoAWQ
GEMM checkpoints with per-expert tensors that qserve reads back bit-exactly, outputs near the float
model (and a broken per-expert scale is caught), routing unchanged by the folded scales, and the
starved-expert fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qserve import LLM, SamplingParams
from qserve.layers.moe import SparseMoeBlock
from qserve.quantize import QuantizeOptions, quantize_checkpoint
from qserve.quantize.quantizer import quantize_rtn
from quant_kernels.moe_layout import StackedQuantWeight
from quant_kernels.reference import dequantize_input_order
from tests.helpers.moe_models import checkpoint_tensors, expert_names, load_into_oracle, moe_oracle, save_moe
from tests.integration.test_hf_parity import hf_greedy, hf_prompt_logprobs
from tests.quantize.conftest import CALIB_TEXT
from tests.quantize.test_checkpoint_format import awq_gemm_dequant, read_all

ARCHS = ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"]
# Mean |Δ logprob| of the quantized model's prompt tokens against the float model's (tiny models,
# hidden 64, g32: every linear's 4-bit error adds up). The outlier models below measure 0.12-0.15
# with AWQ, and 0.29-0.47 when each expert's down scale is not folded out of its up_proj.
TOLERANCE = 0.2
PROMPTS = [CALIB_TEXT[:300], CALIB_TEXT[500:800], "def add(a, b):\n    return a * b + 1\n"]


def outlier_oracle(arch: str, seed: int, factor: float = 16.0, **overrides):  # noqa: ANN201
    """A float MoE model whose experts each have four salient down_proj input channels of their
    own (``up`` rows × factor, ``down`` columns ÷ factor: the same function): what AWQ's
    per-expert scales exist for, and what makes a misapplied one visible."""
    model = moe_oracle(arch, seed=seed, **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = getattr(layer.mlp, "experts", None)
            if experts is None:
                continue
            inter = experts.down_proj.shape[-1]
            for e in range(experts.down_proj.shape[0]):
                channels = [(4 * e + j) % inter for j in range(4)]
                experts.gate_up_proj[e, [inter + c for c in channels]] *= factor
                experts.down_proj[e][:, channels] /= factor
    return model


def quantize(src: Path, dst: Path, calib: Path, **kwargs):  # noqa: ANN201
    meant: dict[str, torch.Tensor] = {}
    options = QuantizeOptions(method="awq", group_size=32, calib=str(calib), num_samples=8, seq_len=64,
                              device="cpu", progress=False, **kwargs)  # fmt: skip
    report = quantize_checkpoint(src, dst, options, observer=lambda n, q: meant.__setitem__(n, q.dequantize()))
    return report, meant


def prompt_logprobs(path: Path) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = LLM(str(path), device="cpu", dtype="float32").generate(PROMPTS, params)
    return torch.cat(
        [
            torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids) if i > 0])
            for o in outs
        ]
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_awq_moe_checkpoint_reads_back_exactly(tmp_path, calib_file, arch) -> None:
    """AutoAWQ's quantization_config keys, per-expert GEMM tensors (router 16-bit), the files'
    dequantized weights == the quantizer's == qserve's stacked experts, and qserve's outputs ==
    the transformers model holding those weights."""
    model = outlier_oracle(arch, seed=31)
    src = save_moe(model, tmp_path / "src")
    dst = tmp_path / "awq"
    report, meant = quantize(src, dst, calib_file)

    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    not_converted = {"MixtralForCausalLM": ["gate"], "Qwen2MoeForCausalLM": ["mlp.gate", "mlp.shared_expert_gate"]}
    assert qc == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": not_converted.get(arch),
    }  # fmt: skip  (Qwen3's tiny model has a dense layer)
    tensors = read_all(dst)
    block, gate, up, down = expert_names(arch)
    layer = "model.layers.1"
    for e in range(8):
        for proj, (k, n) in ((gate, (64, 32)), (up, (64, 32)), (down, (32, 64))):
            name = f"{layer}.{block}.experts.{e}.{proj}"
            assert tensors[f"{name}.qweight"].shape == (k, n // 8) and tensors[f"{name}.scales"].shape == (k // 32, n)
            assert torch.equal(awq_gemm_dequant(tensors, name, 32), meant[name]), name
    assert tensors[f"{layer}.{block}.gate.weight"].dtype == torch.float16  # the router: 16-bit, not quantized
    assert not any(n.startswith(f"{layer}.{block}.gate.q") for n in tensors)
    assert all(torch.equal(awq_gemm_dequant(tensors, name, 32), value) for name, value in meant.items())
    assert not any(
        n.endswith("_proj.weight") or n.endswith((".w1.weight", ".w2.weight", ".w3.weight")) for n in tensors
    )

    llm = LLM(str(dst), device="cpu", dtype="float32")
    blocks = [m for m in llm.engine.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks
    for block_module, index in zip(blocks, llm.engine.model_config.moe_layers):
        assert isinstance(block_module.w_gate_up, StackedQuantWeight) and block_module.w_gate_up.zeros is not None
        prefix = f"model.layers.{index}.{block}.experts"
        for e in range(8):
            gate_up = dequantize_input_order(block_module.w_gate_up.expert(e), torch.float32)  # [H, 2I]
            expected = torch.cat([meant[f"{prefix}.{e}.{gate}"], meant[f"{prefix}.{e}.{up}"]], dim=1)
            assert torch.equal(gate_up, expected), (index, e)
            assert torch.equal(
                dequantize_input_order(block_module.w_down.expert(e), torch.float32), meant[f"{prefix}.{e}.{down}"]
            )

    # the oracle: transformers' model holding the files' weights (dequantized linears, folded norms, scaled routers)
    as_written = {}
    for name in checkpoint_tensors(model):
        module = name.removesuffix(".weight")
        as_written[name] = (
            awq_gemm_dequant(tensors, module, 32).t() if f"{module}.qweight" in tensors else tensors[name]
        )
    load_into_oracle(model, as_written)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    prompts = [[5, 17, 42, 99, 3], list(range(10, 47))]
    for prompt, output in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params)):
        ours = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
        assert torch.allclose(ours, hf_prompt_logprobs(model, prompt), atol=1e-4, rtol=0)
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, 6)
    assert report.fallback == ()


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_awq_moe_outputs_near_the_float_model(tmp_path, calib_file, monkeypatch, arch) -> None:
    """Within TOLERANCE of the float model; the same quantization with each expert's down scale
    left in its down_proj but not divided out of its up_proj (a broken per-expert scale) is not."""
    src = save_moe(outlier_oracle(arch, seed=21), tmp_path / "src")
    reference = prompt_logprobs(src)
    quantize(src, tmp_path / "awq", calib_file)
    error = float((prompt_logprobs(tmp_path / "awq") - reference).abs().mean())
    assert error < TOLERANCE, error

    import qserve.quantize.awq_moe as awq_moe

    monkeypatch.setattr(awq_moe, "fold_into_linear", lambda prev, s, nxt: nxt.weight.mul_(s.to(nxt.weight.dtype)))
    quantize(src, tmp_path / "broken", calib_file)
    broken = float((prompt_logprobs(tmp_path / "broken") - reference).abs().mean())
    assert broken > TOLERANCE, broken


def test_awq_moe_folds_the_gate_scale_into_the_router() -> None:
    """The shared gate/up scale divides post_attention_layernorm; the router and the shared-expert
    gate (16-bit) get it in their columns, so router logits and the shared gate are unchanged."""
    from qserve.layers.rotary import RotaryEmbedding
    from qserve.model.registry import model_config
    from qserve.quantize.awq import AWQSettings
    from qserve.quantize.awq_moe import quantize_layer_awq_moe
    from qserve.quantize.moe import MoEQuantReport, SparseDecoderLayer

    model = moe_oracle("Qwen2MoeForCausalLM", seed=33)
    config = model_config(model.config.to_dict())
    tensors = {
        k[len("model.layers.1.") :]: v for k, v in checkpoint_tensors(model).items() if k.startswith("model.layers.1.")
    }
    tensors["post_attention_layernorm.weight"][:4] *= 8.0  # salient channels: a scale far from one
    layer = SparseDecoderLayer(config, dict(tensors), RotaryEmbedding(config.rope, config.head_dim, 16), "cpu")
    norm = layer.norm("post_attention_layernorm")
    before_norm, before_router = norm.weight.clone(), layer.plain["mlp.gate.weight"].clone()
    before_shared = layer.plain["mlp.shared_expert_gate.weight"].clone()
    hidden = torch.randn(4, 16, config.hidden_size)  # [S, T, H]
    h = torch.randn(64, config.hidden_size)
    logits = F.linear(norm(h), before_router)
    shared = F.linear(norm(h), before_shared)

    _, alphas = quantize_layer_awq_moe(layer, hidden, AWQSettings(4, 32), 2, MoEQuantReport())
    s = before_norm / norm.weight  # the folded scale
    assert alphas["gate_up"] > 0 and float(s.max() / s.min()) > 1.5
    assert torch.allclose(layer.plain["mlp.gate.weight"], before_router * s, rtol=1e-6)
    assert torch.allclose(F.linear(norm(h), layer.plain["mlp.gate.weight"]), logits, atol=1e-5)
    assert torch.allclose(F.linear(norm(h), layer.plain["mlp.shared_expert_gate.weight"]), shared, atol=1e-5)


def test_awq_moe_starved_experts_fall_back_and_load(tmp_path, calib_file) -> None:
    """A router that sends every token to experts 0 and 1: experts 2-7 get no calibration token,
    so their down_proj takes the fallback (no scale: AutoAWQ min-max of the original weight),
    the report lists them, and the checkpoint loads and matches its oracle."""
    model = outlier_oracle("Qwen3MoeForCausalLM", seed=34, mlp_only_layers=[], num_hidden_layers=1)
    with torch.no_grad():  # channel 0 of every hidden state is 3 (> 0), so the router's sign decides
        model.model.embed_tokens.weight[:, 0] = 3.0
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        attn.o_proj.weight[0] = 0.0  # attention leaves channel 0 alone
        mlp.gate.weight.zero_()
        mlp.gate.weight[:2, 0] = 5.0
        mlp.gate.weight[2:, 0] = -5.0
    src = save_moe(model, tmp_path / "src")
    original = checkpoint_tensors(model)
    report, meant = quantize(src, tmp_path / "awq", calib_file)

    starved = {f"model.layers.0.mlp.experts.{e}.down_proj" for e in range(2, 8)}
    assert set(report.fallback) == starved
    for name in starved:
        plain = quantize_rtn(original[f"{name}.weight"], 4, 32, sym=False, style="awq")
        assert torch.equal(meant[name], plain.dequantize()), name
    fed = "model.layers.0.mlp.experts.0.down_proj"
    plain = quantize_rtn(original[f"{fed}.weight"], 4, 32, sym=False, style="awq")
    assert not torch.equal(meant[fed], plain.dequantize())  # a fed expert got its own scale

    llm = LLM(str(tmp_path / "awq"), device="cpu", dtype="float32")
    tensors = read_all(tmp_path / "awq")
    as_written = {}
    for name in original:
        module = name.removesuffix(".weight")
        as_written[name] = (
            awq_gemm_dequant(tensors, module, 32).t() if f"{module}.qweight" in tensors else tensors[name]
        )
    load_into_oracle(model, as_written)
    prompt = [5, 17, 42, 99, 3, 8, 21]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    ours = torch.tensor([output.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
    assert torch.allclose(ours, hf_prompt_logprobs(model, prompt), atol=1e-4, rtol=0)
