"""The quantization algorithms on single layers: GPTQ beats RTN, AWQ beats RTN, act-order and group bookkeeping."""

from __future__ import annotations

import pytest
import torch

from qserve.model.registry import model_config
from qserve.quantize.awq import AWQSettings, search_scales
from qserve.quantize.gptq import GPTQSettings, HessianAccumulator, gptq_quantize_weight
from qserve.quantize.quantizer import pseudo_quantize, quantize_rtn


def correlated_inputs(num_tokens: int, dim: int, seed: int) -> torch.Tensor:
    """Activations with strongly correlated channels and uneven scales: [num_tokens, dim]."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(num_tokens, dim // 8, generator=gen)
    mix = torch.randn(dim // 8, dim, generator=gen)
    scales = torch.rand(dim, generator=gen) * 3 + 0.1
    return (latent @ mix + 0.1 * torch.randn(num_tokens, dim, generator=gen)) * scales


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> float:
    return float(torch.linalg.norm(x @ weight.t() - x @ approx.t()))


@pytest.mark.parametrize(("group_size", "sym", "desc_act"), [(32, True, False), (32, False, True), (-1, True, False)])
def test_gptq_beats_rtn_on_layer_output_error(group_size: int, sym: bool, desc_act: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 128, generator=gen) * 0.05  # [N, K]
    x = correlated_inputs(2048, 128, seed=2)  # [tokens, K]
    acc = HessianAccumulator(128, "cpu")
    for chunk in x.split(256):
        acc.add(chunk)
    torch.testing.assert_close(acc.hessian, 2 * x.t() @ x / x.shape[0], rtol=1e-4, atol=1e-3)

    settings = GPTQSettings(bits=4, group_size=group_size, sym=sym, desc_act=desc_act, block_size=64)
    gptq = gptq_quantize_weight(weight, acc.hessian, settings)
    rtn = quantize_rtn(weight, 4, group_size, sym, min_zero=1)
    err_gptq = output_error(x, weight, gptq.weight())
    err_rtn = output_error(x, weight, rtn.weight())
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def test_gptq_act_order_g_idx_names_the_group_of_each_original_row() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 64, generator=gen)
    x = correlated_inputs(512, 64, seed=4)
    hessian = 2 * x.t() @ x / x.shape[0]
    q = gptq_quantize_weight(weight, hessian, GPTQSettings(bits=4, group_size=16, sym=True, desc_act=True))
    perm = torch.argsort(torch.diag(hessian), descending=True)
    expected = torch.empty(64, dtype=torch.int64)
    expected[perm] = torch.arange(64) // 16  # permuted column j belongs to group j // G
    assert torch.equal(q.g_idx.long(), expected)
    assert torch.bincount(q.g_idx.long()).tolist() == [16, 16, 16, 16]
    assert not torch.equal(q.g_idx.long(), torch.arange(64) // 16)  # genuinely permuted
    # Dequantization through g_idx reproduces values on each group's grid.
    deq = q.dequantize()  # [K, N]
    for g in range(4):
        rows = q.g_idx.long() == g
        steps = deq[rows] / q.scales[g].float()
        torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)


def test_asymmetric_zero_points_stay_v1_storable() -> None:
    weight = torch.rand(8, 64) + 0.01  # all positive: a naive zero point would be 0
    q = quantize_rtn(weight, 4, 32, sym=False, min_zero=1)
    assert int(q.zeros.min()) >= 1
    assert float((q.weight() - weight).abs().max()) < float(q.scales.float().max())


def test_awq_beats_rtn_with_outlier_input_channels() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 128, generator=gen) * 0.05  # [N, K]
    x = torch.randn(16, 32, 128, generator=gen)  # [S, T, K]
    outliers = torch.randperm(128, generator=gen)[:6]
    x[..., outliers] *= 40.0  # a few input channels carry huge activations

    def block(inp: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        return inp @ weights[0].t()

    settings = AWQSettings(bits=4, group_size=32, n_grid=20)
    s, alpha, err_awq = search_scales(x, [weight], block, settings, batch_size=8)
    assert alpha > 0
    awq_weight = pseudo_quantize(weight * s, 4, 32) / s
    rtn_weight = pseudo_quantize(weight, 4, 32)
    flat = x.reshape(-1, 128)
    err_awq_out = output_error(flat, weight, awq_weight)
    err_rtn_out = output_error(flat, weight, rtn_weight)
    assert err_awq_out < 0.8 * err_rtn_out, (err_awq_out, err_rtn_out)


def test_awq_layer_folds_scales_and_beats_rtn_on_the_layer_output() -> None:
    """A multi-head (no GQA) Qwen2 layer with biases: every fold (norms, v->o, up->down) is used."""
    from qserve.layers.rotary import RotaryEmbedding
    from qserve.quantize.awq import quantize_layer_awq
    from qserve.quantize.layer import DenseDecoderLayer
    from qserve.quantize.rtn import RTNSettings, quantize_layer_rtn
    from tests.helpers.tiny_models import make_tiny_model

    model = make_tiny_model("Qwen2ForCausalLM", seed=0, num_key_value_heads=4)
    config = model_config(model.config.to_dict() | {"architectures": ["Qwen2ForCausalLM"]})
    prefix = "model.layers.0."
    tensors = {k[len(prefix) :]: v.detach().clone() for k, v in model.state_dict().items() if k.startswith(prefix)}
    rotary = RotaryEmbedding(config.rope, config.head_dim, 32)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(8, 32, config.hidden_size, generator=gen)
    hidden[..., :3] *= 30.0  # outlier channels

    reference = DenseDecoderLayer(config, tensors, rotary, "cpu").run(hidden, 4)
    awq_layer = DenseDecoderLayer(config, tensors, rotary, "cpu")
    _, alphas = quantize_layer_awq(awq_layer, hidden, AWQSettings(bits=4, group_size=32), batch_size=4)
    assert set(alphas) == {"qkv", "o", "gate_up", "down"}
    rtn_layer = DenseDecoderLayer(config, tensors, rotary, "cpu")
    quantize_layer_rtn(rtn_layer, RTNSettings(bits=4, group_size=32, sym=False))
    err_awq = float((awq_layer.run(hidden, 4) - reference).pow(2).mean())
    err_rtn = float((rtn_layer.run(hidden, 4) - reference).pow(2).mean())
    assert err_awq < err_rtn, (err_awq, err_rtn)
