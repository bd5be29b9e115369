"""``W4A16LinearMethod`` / ``make_linear_method`` on a ``Linear`` layer vs a dense matmul."""

from __future__ import annotations

import pytest
import torch

from loaders.spec import CheckpointSpec, DynamicRule
from qserve.layers.linear import DenseLinearMethod, Linear
from qserve.layers.quant_methods import W4A16LinearMethod, make_linear_method
from quant_kernels.layout import PackedQuantWeight, pack_codes
from quant_kernels.reference import dequantize_input_order

K = 64
NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]


def _packed(
    n: int, seed: int, *, bits: int = 4, perm: torch.Tensor | None = None, sym: bool = False
) -> PackedQuantWeight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (K, n), generator=gen)
    scales = (torch.rand(K // 32, n, generator=gen) * 0.1).half()
    zeros = None if sym else torch.randint(0, 1 << bits, (K // 32, n), generator=gen).to(torch.uint8)
    return PackedQuantWeight(bits, 32, pack_codes(codes, bits), scales, zeros, perm)


def _layer(sizes: list[int], method) -> Linear:
    return Linear(
        K, sizes, bias=True, params_dtype=torch.float32, method=method, prefix="model.layers.0.self_attn.qkv_proj"
    )


@pytest.mark.parametrize("shared_perm", [None, "same", "different"])
def test_fused_layer_matches_dense(shared_perm) -> None:
    sizes = [32, 16, 16]
    perms = [None] * 3
    if shared_perm == "same":
        perms = [torch.randperm(K, generator=torch.Generator().manual_seed(1))] * 3
    elif shared_perm == "different":
        perms = [torch.randperm(K, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    shards = [_packed(n, i, perm=p, sym=(i == 1)) for i, (n, p) in enumerate(zip(sizes, perms))]
    layer = _layer(sizes, W4A16LinearMethod(NAMES))
    for i, shard in enumerate(shards):
        layer.load_weight(i, shard)
    bias = torch.randn(64)
    layer.load_bias(0, bias[:32])
    layer.load_bias(1, bias[32:48])
    layer.load_bias(2, bias[48:])
    layer.process_after_loading()
    assert len(layer.quant_prepared) == (3 if shared_perm == "different" else 1)
    dense = torch.cat([dequantize_input_order(s, torch.float32) for s in shards], dim=1)  # [K, N]
    x = torch.randn(5, K)
    torch.testing.assert_close(layer(x), x @ dense + bias, atol=1e-5, rtol=1e-5)
    assert layer.method.weight_nbytes(layer) == sum(p.nbytes() for p in layer.quant_prepared)


def test_only_the_prepared_weights_are_kept(monkeypatch) -> None:
    """On CUDA prepare_w4a16 returns a repacked copy; the canonical weights must not stay alive
    beside it (a 14B model once took 15.5 GiB instead of 9.3)."""
    from qserve.layers import quant_methods

    monkeypatch.setattr(
        quant_methods.ops,
        "prepare_w4a16",
        lambda w: w.to("cpu").__class__(w.bits, w.group_size, w.qweight.clone(), w.scales.clone(), w.zeros, w.perm),
    )
    sizes = [32, 16, 16]
    layer = _layer(sizes, W4A16LinearMethod(NAMES))
    for i, n in enumerate(sizes):
        layer.load_weight(i, _packed(n, i, perm=None, sym=True))
    layer.process_after_loading()
    held = quant_methods.tensor_nbytes([v for v in vars(layer).values() if not isinstance(v, torch.nn.Module)])
    assert held == layer.method.weight_nbytes(layer) == quant_methods.tensor_nbytes(layer.quant_prepared)


def test_shape_validation_names_module_and_shapes() -> None:
    layer = _layer([32, 16, 16], W4A16LinearMethod(NAMES))
    with pytest.raises(ValueError, match=r"k_proj.*N=32.*N=16"):
        layer.load_weight(1, _packed(32, 0))
    with pytest.raises(ValueError, match="dense tensor"):
        layer.load_weight(0, torch.zeros(32, K))
    layer.load_weight(0, _packed(32, 0))
    with pytest.raises(ValueError, match="never loaded"):
        layer.process_after_loading()


def test_make_linear_method() -> None:
    spec = CheckpointSpec(
        method="gptq",
        bits=4,
        group_size=32,
        pack_format="gptq",
        zero_convention="v1",
        dynamic=(DynamicRule(pattern=r".*layers\.1\.self_attn\.k_proj", skip=True),),
    )
    assert isinstance(make_linear_method(spec, NAMES), W4A16LinearMethod)
    assert isinstance(make_linear_method(spec, ["lm_head"]), DenseLinearMethod)
    assert isinstance(make_linear_method(CheckpointSpec(method="none"), NAMES), DenseLinearMethod)
    with pytest.raises(ValueError, match="some but not all shards.*k_proj=unquantized"):
        make_linear_method(spec, [n.replace("layers.0", "layers.1") for n in NAMES])


def test_reference_path_layers_names_the_gpu_layers_no_kernel_serves(monkeypatch) -> None:
    """A weight ``prepare_w4a16`` left canonical on a GPU (a card before sm80, or groups of 24 rows)
    is named, so the loader can warn that every step dequantizes it; on the CPU or the meta device
    (``checkpoint_check``'s tensor check) it is not. The GPU is stood in for by the meta device."""
    from qserve.layers import quant_methods

    def loaded(prefix: str) -> Linear:
        layer = _layer([32, 16, 16], W4A16LinearMethod(NAMES))
        layer.prefix = prefix
        for i, n in enumerate([32, 16, 16]):
            layer.load_weight(i, _packed(n, i, sym=True))
        layer.process_after_loading()
        return layer

    model = torch.nn.ModuleDict({"on_cpu": loaded("model.layers.0.self_attn.qkv_proj")})
    monkeypatch.setattr(quant_methods.ops, "prepare_w4a16", lambda w: w.to("meta"))  # left canonical off the CPU
    model["off_cpu"] = loaded("model.layers.1.self_attn.qkv_proj")
    assert quant_methods.reference_path_layers(model) == []  # the meta device is not a GPU
    monkeypatch.setattr(quant_methods, "_on_gpu", lambda t: t.device.type == "meta")
    assert quant_methods.reference_path_layers(model) == ["model.layers.1.self_attn.qkv_proj"]
